"""A process reward model: a reward model trained with the RM recipe (`run_rm`) on step-labelled data -- each
labelled step becomes a pair (the same prefix continued by a good step and by a bad one) -- that scores every
policy turn of a trajectory; the mean over the turns is the ``process`` component the return weighs."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch
from test_envs_scripted import ScriptedEngine

from posttrain.config import ProcessRewardModelConfig, RMRecipe
from posttrain.envs import rollout_episode
from posttrain.rl.learned import ProcessRewardModel, turn_ends
from posttrain.tasks import get_domain, sample_tasks
from posttrain.train.reward_model import run_rm
from posttrain.types import SamplingParams

END = "<|end|>"


def step_labelled(count: int, rng: random.Random) -> list[dict]:
    """Steps labelled good (a number) or bad (words) for "What is a+b?" prompts, as pairs of one prefix."""
    pairs = []
    for _ in range(count):
        a, b = rng.randrange(100), rng.randrange(100)
        prompt = [{"role": "user", "content": f"{a}+{b}"}]
        good = {"role": "assistant", "content": str(rng.randrange(10, 999))}
        bad = {"role": "assistant", "content": rng.choice(["the invoice", "total is", "calculator", "expression"])}
        pairs.append({"prompt": prompt, "chosen": good, "rejected": bad})
    return pairs


@pytest.fixture(scope="module")
def process_model_dir(tmp_path_factory, policy_dir):
    root = tmp_path_factory.mktemp("prm")
    rng = random.Random(0)
    for split, count in (("train", 256), ("heldout", 32)):
        (root / f"{split}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in step_labelled(count, rng)))
    torch.set_num_threads(1)
    recipe = RMRecipe.model_validate({
        "output_dir": str(root / "run"), "model": {"path": str(policy_dir)},
        "data": {"train": [{"path": str(root / "train.jsonl")}], "heldout": [{"path": str(root / "heldout.jsonl")}],
                 "max_length": 64},
        "optim": {"lr": 3e-3}, "train": {"batch_size": 32, "epochs": 2},
        "runtime": {"num_threads": 1}, "tracking": {"tensorboard": False, "progress": False}})
    run_rm(recipe)
    return root / "run" / "final"


def episode(tokenizer, script, task):
    return asyncio.run(rollout_episode(ScriptedEngine(tokenizer, script), task, tokenizer,
                                       SamplingParams(max_new_tokens=32)))


def test_turn_ends_are_the_ends_of_the_policy_segments():
    assert turn_ends([0, 0, 1, 1, 0, 0, 1, 0, 1, 1]) == [4, 7, 10]
    assert turn_ends([0, 0]) == []


def test_the_process_model_scores_every_turn_and_prefers_good_steps(process_model_dir, tiny_tokenizer):
    prm = ProcessRewardModel(ProcessRewardModelConfig(path=str(process_model_dir)), tiny_tokenizer,
                             torch.device("cpu"))
    arithmetic = sample_tasks(get_domain("arithmetic", operators="+"), 6, level=1, split="heldout", seed=4)
    good = [episode(tiny_tokenizer, ["123" + END], task) for task in arithmetic]
    bad = [episode(tiny_tokenizer, ["the invoice" + END], task) for task in arithmetic]
    task = sample_tasks(get_domain("calculator"), 1, level=1, seed=3)[0]
    call = json.dumps({"name": "calculator", "arguments": {"expression": task.metadata["expression"]}})
    multi = episode(tiny_tokenizer, [f"<tool_call>{call}</tool_call>{END}", task.metadata["answer"] + END], task)

    metrics = prm.annotate([*good, *bad, multi])
    assert "reward/process_model" in metrics
    assert len(multi.reward.details["step_scores"]) == 2  # one score per policy turn
    assert multi.reward.components["process"] == pytest.approx(sum(multi.reward.details["step_scores"]) / 2)
    mean_good = sum(t.reward.components["process"] for t in good) / len(good)
    mean_bad = sum(t.reward.components["process"] for t in bad) / len(bad)
    assert mean_good > mean_bad + 0.5, (mean_good, mean_bad)  # trained on held-out-like steps, it ranks them


def test_an_rl_run_uses_the_process_model_as_the_process_component(process_model_dir, policy_dir, tmp_path):
    from posttrain.config.rl import RLRecipe
    from posttrain.rl import run_rl

    recipe = RLRecipe.model_validate({
        "output_dir": str(tmp_path / "rl"), "model": {"path": str(policy_dir)},
        "domains": [{"name": "arithmetic", "heldout": 0}],
        "process_reward_model": {"path": str(process_model_dir)}, "returns": {"process_weight": 0.5},
        "rollout": {"prompts_per_step": 2, "sampling": {"group_size": 2, "max_new_tokens": 8}},
        "train": {"max_steps": 1, "micro_batch_size": 8}, "pipeline": {"self_test": False, "max_staleness": 0},
        "schedule": {"guard": {"enabled": False}},
        "runtime": {"device": "cpu", "num_threads": 1, "seed": 0},
        "tracking": {"tensorboard": False, "progress": False}})
    result = run_rl(recipe)
    metrics = result.history[-1]
    assert "reward/process_model" in metrics and "return/process" in metrics
    assert metrics["return/process"] == pytest.approx(0.5 * metrics["reward/process_model"], abs=1e-5)
