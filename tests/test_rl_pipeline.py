"""The RL recipe end to end on a tiny model: deterministic pipeline, exact resume, masked infra failures."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from posttrain.config.rl import DomainConfig, RLRecipe
from posttrain.models import build_tiny_model
from posttrain.rl import SelfTestError, engine_trainer_self_test
from posttrain.rl.trainer import run_rl
from posttrain.tasks import domain
from posttrain.tasks.base import task_id
from posttrain.train import Runtime
from posttrain.types import FailureClass, Reward, Task
from posttrain.verify import verifier


@verifier("test_digit_share")
def digit_share(completion: str, *, final_state=None, flaky: bool = False) -> Reward:
    """Reward = share of digits in the completion (a smooth signal even a random model gets)."""
    if flaky and len(completion) % 3 == 0:
        raise RuntimeError("simulated verifier infrastructure failure")
    text = completion.strip()
    score = sum(ch.isdigit() for ch in text) / max(len(text), 1)
    return Reward(score=score, passed=score > 0.5)


@domain("test_digits")
class DigitDomain:
    name = "test_digits"
    max_level = 1

    def __init__(self, flaky: bool = False):
        self.flaky = flaky

    def make_task(self, rng: random.Random, level: int) -> Task:
        key = f"digits {rng.randrange(10**6)}"
        return Task(id=task_id(self.name, key), domain=self.name, messages=[{"role": "user", "content": key}],
                    verifier="test_digit_share", verifier_args={"flaky": self.flaky},
                    metadata={"problem_key": key})

    def demonstration(self, task):  # pragma: no cover - not used in these tests
        raise NotImplementedError


def recipe(policy_dir, output, **pipeline) -> RLRecipe:
    return RLRecipe.model_validate({
        "output_dir": str(output),
        "model": {"path": str(policy_dir)},
        "domains": [{"name": "test_digits", "heldout": 0}],
        "rollout": {"prompts_per_step": 3, "sampling": {"group_size": 4, "max_new_tokens": 8}},
        "optim": {"lr": 1e-3},
        "train": {"max_steps": 4, "micro_batch_size": 6, "save_every": 2},
        "pipeline": {"self_test": False, **pipeline},
        "runtime": {"precision": "fp32"},
        "tracking": {"tensorboard": False, "progress": False},
    })


def losses(result):
    return [(m["train/loss"], m["reward/mean"]) for m in result.history]


def schedule_figures(result):
    """The scheduler's per-batch snapshot (curriculum, mix, counters) and the dynamic-sampling counts."""
    return [{k: v for k, v in m.items() if k.startswith(("curriculum/", "mix/", "schedule/", "dynamic/"))}
            for m in result.history]


def weights(directory):
    return load_file(str(directory / "model.safetensors"))


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


@pytest.mark.parametrize("staleness", [0, 1])
def test_overlapped_pipeline_equals_inline_loop_bit_for_bit(policy_dir, tmp_path, staleness):
    inline = run_rl(recipe(policy_dir, tmp_path / "inline", max_staleness=staleness, overlap=False))
    threaded = run_rl(recipe(policy_dir, tmp_path / "threaded", max_staleness=staleness, overlap=True))
    assert losses(inline) == losses(threaded)
    assert schedule_figures(inline) == schedule_figures(threaded) and "mix/trained/test_digits" in inline.history[-1]
    assert any(loss != 0.0 for loss, _ in losses(inline))  # the runs trained on something
    assert_same_weights(inline.final_dir, threaded.final_dir)
    assert [m["policy/staleness"] for m in inline.history] == [0, 0 if staleness == 0 else 1, staleness, staleness][
        : len(inline.history)] or staleness == 0


def test_resume_after_a_crash_continues_exactly(policy_dir, tmp_path):
    full = run_rl(recipe(policy_dir, tmp_path / "full", max_staleness=1))

    def crash(step, metrics):
        if step == 3:
            raise KeyboardInterrupt("simulated crash after step 3 (checkpoint at step 2)")

    with pytest.raises(KeyboardInterrupt):
        run_rl(recipe(policy_dir, tmp_path / "crashed", max_staleness=1), on_step=crash)
    resumed = run_rl(recipe(policy_dir, tmp_path / "crashed", max_staleness=1), resume=True)
    # the result covers the whole run: the steps before the checkpoint come back from metrics.jsonl (the demo's
    # compute count and judging share are summed over it), the crashed process's step 3 is re-run and replaced
    assert [m["policy/version"] for m in resumed.history] == [0.0, 1.0, 2.0, 3.0]
    assert losses(resumed) == losses(full)
    assert schedule_figures(resumed) == schedule_figures(full)  # the scheduler's state resumed exactly
    assert [m["tokens/sampled"] for m in resumed.history] == [m["tokens/sampled"] for m in full.history]
    assert_same_weights(full.final_dir, resumed.final_dir)


def test_a_fresh_run_moves_aside_the_logs_of_a_run_that_died_before_its_first_checkpoint(policy_dir, tmp_path):
    """The RL stage appends to episodes.jsonl and schedule_events.jsonl besides metrics.jsonl: after a run that died
    before saving anything, a fresh run's files hold its own steps only, the dead run's move whole to earlier-1/."""
    import json

    def crash(step, metrics):
        if step == 1:
            raise KeyboardInterrupt("simulated crash at step 1 (first checkpoint at step 2)")

    config = recipe(policy_dir, tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        run_rl(config, on_step=crash)
    dead = {name: (tmp_path / "run" / name).read_bytes() for name in ("episodes.jsonl", "metrics.jsonl")}
    assert dead["episodes.jsonl"] and not (tmp_path / "run" / "checkpoints").exists()
    config.train.max_steps = 2
    run_rl(config)
    for name, content in dead.items():
        assert (tmp_path / "run" / "earlier-1" / name).read_bytes() == content, name
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == [0, 1] and len(steps) == 2 * 3 * 4  # its two batches of 3 x 4 episodes, no more


def test_infrastructure_failures_are_masked_not_scored(policy_dir, tmp_path):
    config = recipe(policy_dir, tmp_path / "flaky")
    config.domains = [DomainConfig(name="test_digits", args={"flaky": True}, heldout=0)]
    config.rollout.infra_retries = 0
    config.train.max_steps = 2
    result = run_rl(config)
    masked = sum(m.get("rollout/infra_masked", 0) for m in result.history)
    failures = sum(m.get(f"failures/{FailureClass.INFRA.value}", 0) for m in result.history)
    assert masked > 0 and masked == failures
    episodes = (tmp_path / "flaky" / "episodes.jsonl").read_text().count('"failure": "infra"')
    assert episodes == masked


def test_self_test_catches_weights_that_never_reached_the_engine(policy_dir, tiny_tokenizer):
    from posttrain.config import ModelConfig
    from posttrain.models import load_model
    from posttrain.rollout import HFEngine

    model = load_model(ModelConfig(path=str(policy_dir)), tiny_tokenizer)
    engine = HFEngine(build_tiny_model("tiny-1m", tiny_tokenizer, seed=0), tiny_tokenizer)
    tasks = [DigitDomain().make_task(random.Random(i), 1) for i in range(4)]
    runtime = Runtime(device=torch.device("cpu"), autocast_dtype=None)
    stats = engine_trainer_self_test(engine, model, tiny_tokenizer, tasks, runtime, temperature=1.0, max_new_tokens=6)
    assert stats["gap_abs_max"] < 1e-4
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))  # the trainer moved on; the engine was never told
    with pytest.raises(SelfTestError, match="not running the trainer's policy"):
        engine_trainer_self_test(engine, model, tiny_tokenizer, tasks, runtime, temperature=1.0, max_new_tokens=6)


def test_steps_are_the_budget_and_the_time_cap_warns_when_it_cuts_a_run(policy_dir, tmp_path, capsys):
    full = run_rl(recipe(policy_dir, tmp_path / "full"))
    assert full.stopped_by == "steps" and full.steps == 4
    # the step's compute, counted for the demo's compute-matched control: every sampled token, every trained one
    assert all(m["tokens/sampled"] >= m["tokens/trained"] > 0 for m in full.history)
    # ... less the zero-advantage sequences the update skipped (a fresh policy: most groups all fail), which the
    # step logs; nothing here is masked out, so sampled = trained + skipped
    assert all(m["tokens/sampled"] == m["tokens/trained"] + m["train/skipped_zero_adv_tokens"] for m in full.history)
    assert sum(m["train/skipped_zero_adv_sequences"] for m in full.history) > 0
    assert all(0.0 <= m["time/judge_s"] <= m["time/step_s"] for m in full.history)
    assert all(m["time/step_cpu_s"] > 0.0 for m in full.history)  # what the step cost, whatever else ran
    capped = recipe(policy_dir, tmp_path / "capped")
    capped.train.max_minutes = 1e-6
    result = run_rl(capped)
    assert result.stopped_by == "time_cap" and result.steps == 1
    assert "WARNING: the time cap of 1e-06 min cut training short at step 1 of 4" in capsys.readouterr().err
