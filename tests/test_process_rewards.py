"""Process rewards: per-step rewards flow into the return as a ``process`` component beside the outcome.

Fast: a tool env's step checks (the share of a step's calls that succeeded) become the reward's ``process``
component and `episode_return` weighs it by ``process_weight``. Slow: GRPO on a Gymnasium env whose outcome is
sparse (success only when the reply is all digits) and whose step reward is dense (the reply's digit share):
from a fresh tiny model the outcome alone gives (almost) no group any spread, so nothing is learned, while
outcome + process learns -- the digit share climbs within a few steps.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from test_envs_scripted import ScriptedEngine

from posttrain.config.rl import ReturnConfig
from posttrain.envs import rollout_episode
from posttrain.rl import episode_return
from posttrain.tasks import get_domain, sample_tasks
from posttrain.types import SamplingParams

END = "<|end|>"
_RECIPES = Path(__file__).resolve().parents[1] / "src" / "posttrain" / "recipes"


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>{END}"


def test_tool_step_checks_are_the_process_component_of_the_return(tiny_tokenizer):
    task = sample_tasks(get_domain("calculator", max_steps=4), 1, level=1, seed=2)[0]
    expression, answer = task.metadata["expression"], task.metadata["answer"]
    script = [call("calculator", expression="1/0"), call("calculator", expression=expression), answer + END]
    trajectory = asyncio.run(rollout_episode(ScriptedEngine(tiny_tokenizer, script), task, tiny_tokenizer,
                                             SamplingParams(max_new_tokens=64)))
    assert trajectory.reward.passed and trajectory.reward.details["step_rewards"] == [0.0, 1.0, None]
    assert trajectory.reward.components["process"] == pytest.approx(0.5)  # one of two tool steps succeeded

    total, parts = episode_return(trajectory, ReturnConfig(process_weight=0.4), max_new_tokens=64)
    assert parts == {"outcome": 1.0, "process": pytest.approx(0.2)} and total == pytest.approx(1.2)
    outcome_only, parts = episode_return(trajectory, ReturnConfig(), max_new_tokens=64)
    assert outcome_only == 1.0 and "process" not in parts


def _digit_share_after_training(output, process_weight: float) -> list[float]:
    from posttrain.config.rl import RLRecipe
    from posttrain.rl import run_rl

    recipe = RLRecipe.model_validate({
        "output_dir": str(output),
        "imports": [str(_RECIPES / "env_digits.py")],
        "domains": [{"name": "gym", "heldout": 0, "args": {"env_id": "posttrain/Digits-v0", "max_steps": 1,
                                                           "outcome": "success"}}],
        "rollout": {"prompts_per_step": 8, "sampling": {"group_size": 4, "max_new_tokens": 12}},
        "returns": {"process_weight": process_weight},
        "algorithm": {"advantage": "grpo"},
        "optim": {"lr": 3e-3},
        "train": {"max_steps": 12, "micro_batch_size": 32},
        "pipeline": {"self_test": False, "max_staleness": 0},
        "schedule": {"guard": {"enabled": False}},
        "runtime": {"precision": "fp32", "device": "cpu", "num_threads": 1, "seed": 0},
        "tracking": {"tensorboard": False, "progress": False},
    })
    run_rl(recipe)
    episodes = [json.loads(line) for line in (output / "episodes.jsonl").read_text().splitlines()]
    by_step: dict[int, list[float]] = {}
    for episode in episodes:
        by_step.setdefault(episode["step"], []).append(episode["details"]["step_rewards"][0])
    return [sum(v) / len(v) for _, v in sorted(by_step.items())]


@pytest.mark.slow
def test_a_process_signal_makes_a_sparse_outcome_learnable_faster(tmp_path):
    # The fresh built-in tiny model (model.path unset), as the packaged grpo-gym recipe starts from.
    outcome_only = _digit_share_after_training(tmp_path / "outcome", process_weight=0.0)
    hybrid = _digit_share_after_training(tmp_path / "hybrid", process_weight=1.0)
    late_outcome, late_hybrid = sum(outcome_only[-3:]) / 3, sum(hybrid[-3:]) / 3
    print(f"digit share per step, outcome only: {[round(x, 3) for x in outcome_only]}")
    print(f"digit share per step, outcome + process: {[round(x, 3) for x in hybrid]}")
    assert outcome_only[0] == pytest.approx(hybrid[0])  # the same start: same model, same seeds
    assert late_hybrid > late_outcome + 0.15 and late_hybrid > 2 * hybrid[0]
