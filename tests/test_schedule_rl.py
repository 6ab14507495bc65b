"""The scheduler inside the RL trainer, on a tiny model: determinism with the scheduler's state (threaded equals
inline, exact resume), schedule metrics and final figures, the forgetting guard, and rollback on an alarm."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from posttrain.config.rl import RLRecipe
from posttrain.evaluate import SuiteScore
from posttrain.rl.trainer import run_rl
from posttrain.tasks import domain, split_of
from posttrain.tasks.base import demo_sample, task_id
from posttrain.types import Reward, Task
from posttrain.verify import verifier

BROKEN: set[str] = set()  # domains whose held-out items a test has "broken" (a forced regression)


@verifier("sched_e2e_reward")
def sched_reward(completion: str, *, final_state=None, kind: str = "share", domain_name: str = "",
                 answer: str = "", key: str = "") -> Reward:
    """share: the share of digits (smooth); exact: the sum (all-fail groups for an untrained model); always: 1.
    A broken domain fails its held-out items only: training rewards (read by the producer's thread at times no
    test controls) stay the same."""
    text = completion.strip()
    if domain_name in BROKEN and split_of(key) == "heldout":
        return Reward(score=0.0, passed=False)
    if kind == "always":
        return Reward(score=1.0, passed=True)
    if kind == "exact":
        return Reward(score=float(text == answer), passed=text == answer)
    score = sum(ch.isdigit() for ch in text) / max(len(text), 1)
    return Reward(score=score, passed=score > 0.3)


class SumDomain:
    max_level = 3

    def __init__(self, name: str, kind: str):
        self.name, self.kind = name, kind

    def make_task(self, rng: random.Random, level: int) -> Task:
        a, b = rng.randrange(10**level), rng.randrange(10**level)
        key = f"{a}+{b}"
        return Task(id=task_id(self.name, key), domain=self.name, difficulty=level,
                    messages=[{"role": "user", "content": key}], verifier="sched_e2e_reward",
                    verifier_args={"kind": self.kind, "domain_name": self.name, "answer": str(a + b),
                                   "key": key},
                    metadata={"problem_key": key, "answer": str(a + b)})

    def demonstration(self, task: Task):
        return demo_sample(task, task.metadata["answer"], None)


for _name, _kind in [("sched_e2e_share", "share"), ("sched_e2e_exact", "exact"), ("sched_e2e_a", "always"),
                     ("sched_e2e_b", "always")]:
    domain(_name)(lambda _name=_name, _kind=_kind: SumDomain(_name, _kind))


def recipe(policy_dir, output, **sections) -> RLRecipe:
    base = {
        "output_dir": str(output),
        "model": {"path": str(policy_dir)},
        "domains": [{"name": "sched_e2e_share", "weight": 2.0, "levels": [1, 2, 3], "heldout": 0},
                    {"name": "sched_e2e_exact", "heldout": 0}],
        "rollout": {"prompts_per_step": 3, "sampling": {"group_size": 4, "max_new_tokens": 8}},
        "optim": {"lr": 1e-3},
        "train": {"max_steps": 4, "micro_batch_size": 12, "save_every": 2},
        "pipeline": {"self_test": False, "max_staleness": 1},
        "runtime": {"precision": "fp32"},
        "tracking": {"tensorboard": False, "progress": False},
        "schedule": {
            "dynamic_sampling": {"mode": "drop", "max_extra_groups": 1.0, "max_rounds": 2},
            "curriculum": {"min_episodes": 4, "window": 8, "upper": 0.3, "lower": 0.02},
            "priority": {"pool_size": 4, "retire_min_episodes": 4, "reprobe_prob": 0.3},
            "dedup_window": 2,
        },
    }
    for key, value in sections.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
    return RLRecipe.model_validate(base)


SCHEDULE_PREFIXES = ("curriculum/", "mix/", "dynamic/", "schedule/", "rollout/", "reward/", "guard/")


def figures(result) -> list[dict[str, float]]:
    """What must not depend on threads or on a resume: losses, rewards, and every schedule metric."""
    return [{k: v for k, v in m.items() if k.startswith(SCHEDULE_PREFIXES) or k in ("train/loss", "train/lr")}
            for m in result.history]


def assert_same_weights(a, b):
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def threaded_run(policy_dir, tmp_path_factory):
    return run_rl(recipe(policy_dir, tmp_path_factory.mktemp("threaded")))


def test_threaded_equals_inline_with_the_scheduler_and_reports_its_figures(policy_dir, tmp_path, threaded_run):
    inline = run_rl(recipe(policy_dir, tmp_path / "inline", pipeline={"overlap": False}))
    assert figures(inline) == figures(threaded_run)
    assert_same_weights(inline.final_dir, threaded_run.final_dir)
    last = threaded_run.history[-1]
    for name in ("sched_e2e_share", "sched_e2e_exact"):
        for key in (f"curriculum/{name}", f"mix/sampled/{name}", f"mix/trained/{name}", f"mix/target/{name}"):
            assert key in last, key
    for key in ("dynamic/groups", "dynamic/kept", "dynamic/dropped_zero_spread", "dynamic/refill_groups",
                "dynamic/short", "schedule/dedup_redraws", "schedule/infra_requeued", "guard/rollbacks"):
        assert key in last, key
    assert sum(m["dynamic/dropped_zero_spread"] for m in threaded_run.history) > 0  # the exact domain's all-fail groups
    assert any(m.get("train/loss", 0.0) != 0.0 for m in threaded_run.history)
    assert threaded_run.curriculum == {n: int(last[f"curriculum/{n}"]) for n in ("sched_e2e_share", "sched_e2e_exact")}
    assert sum(threaded_run.mix_trained.values()) == pytest.approx(1.0)
    assert threaded_run.mix_sampled == {n: last[f"mix/sampled/{n}"] for n in threaded_run.mix_sampled}
    summary = json.loads((threaded_run.output_dir / "schedule_summary.json").read_text())
    assert summary["curriculum"] == threaded_run.curriculum and summary["mix_trained"] == threaded_run.mix_trained


def test_resume_restores_the_scheduler_exactly(policy_dir, tmp_path, threaded_run):
    def crash(step, metrics):
        if step == 3:
            raise KeyboardInterrupt("simulated crash after step 3 (checkpoint at step 2)")

    with pytest.raises(KeyboardInterrupt):
        run_rl(recipe(policy_dir, tmp_path / "crashed"), on_step=crash)
    resumed = run_rl(recipe(policy_dir, tmp_path / "crashed"), resume=True)
    assert [m["policy/version"] for m in resumed.history] == [0.0, 1.0, 2.0, 3.0]  # steps 1-2 from metrics.jsonl
    assert figures(resumed) == figures(threaded_run)
    assert_same_weights(threaded_run.final_dir, resumed.final_dir)


def test_a_resumed_run_reports_every_evaluation_of_the_whole_run(policy_dir, tmp_path):
    """The guard's evaluations before the checkpoint (the baseline, step 2) come back from metrics.jsonl; the
    crashed process's evaluation at step 4, past the checkpoint, is re-run, not counted twice."""
    def config(name):
        return recipe(policy_dir, tmp_path / name,
                      domains=[{"name": "sched_e2e_a", "heldout": 6}, {"name": "sched_e2e_b", "heldout": 6}],
                      train={"max_steps": 6, "eval_every": 2, "save_every": 3})

    def crash(step, metrics):
        if step == 5:
            raise KeyboardInterrupt("simulated crash after step 5 (checkpoint at step 3)")

    def figures_of(result):
        return [{k: v for k, v in e.items() if k != "seconds"} for e in result.evaluations]

    full = run_rl(config("full"))
    with pytest.raises(KeyboardInterrupt):
        run_rl(config("crashed"), on_step=crash)
    resumed = run_rl(config("crashed"), resume=True)
    assert [e["step"] for e in full.evaluations] == [0, 2, 4, 6, 6]  # baseline, every 2 steps, final
    assert "heldout/sched_e2e_a" in full.evaluations[0] and full.evaluations[-1]["final"] == 1.0
    assert figures_of(resumed) == figures_of(full)
    assert all(e["seconds"] > 0 for e in resumed.evaluations)


def test_forced_regression_boosts_the_domain_and_mixes_in_replay(policy_dir, tmp_path, capsys):
    def break_b(step, metrics):
        if step == 1:
            BROKEN.add("sched_e2e_b")  # from now on domain b fails its held-out items

    def run(name, overlap):
        config = recipe(policy_dir, tmp_path / name,
                        domains=[{"name": "sched_e2e_a", "heldout": 6}, {"name": "sched_e2e_b", "heldout": 6}],
                        pipeline={"overlap": overlap}, train={"max_steps": 5, "eval_every": 2, "save_every": None},
                        schedule={"dynamic_sampling": {"mode": "keep"},
                                  "guard": {"threshold": 0.1, "recover": 0.05, "boost": 1.5, "replay_samples": 4,
                                            "replay_coef": 0.5}})
        try:
            return run_rl(config, on_step=break_b)
        finally:
            BROKEN.clear()

    result = run("threaded", True)
    regressions = [e for e in result.events if e["kind"] == "regression"]
    assert [(e["suite"], e["step"], e["best"], e["value"]) for e in regressions] == [("sched_e2e_b", 2, 1.0, 0.0)]
    assert regressions[0]["actions"] == ["boost sched_e2e_b", "replay SFT"]
    history = {int(m["policy/version"]): m for m in result.history}  # version = step - 1
    assert history[1]["guard/event/regression"] == 1.0 and history[1]["guard/regressed/sched_e2e_b"] == 1.0
    assert "guard/replay_loss" not in history[1] and history[2]["guard/replay_loss"] > 0  # replay from step 3 on
    # The boost starts at batch 2 + max_staleness + 1, fixed in advance: the producer may already be drawing batch 3.
    assert history[3]["mix/target/sched_e2e_b"] == 0.5
    assert history[4]["mix/target/sched_e2e_b"] == pytest.approx(0.75)
    assert result.heldout["sched_e2e_b"] == 0.0 and result.heldout["sched_e2e_a"] == 1.0
    assert "guard: suite 'sched_e2e_b' fell to 0.000" in capsys.readouterr().err
    logged = [json.loads(line) for line in (tmp_path / "threaded" / "schedule_events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in logged] == ["regression"]
    assert figures(run("inline", False)) == figures(result)


def test_a_regression_outside_the_mix_replays_that_domain_and_boosts_nothing(policy_dir, tmp_path):
    # RL trains only domain a; the guard watches b from a file of its held-out items (as the demo's guard items
    # do for the domains SFT trained and RL does not), with b's generator named for the replay.
    from posttrain.rl.guarding import RunGuard, regression_suites
    from posttrain.tasks import get_domain, sample_tasks

    items = sample_tasks(get_domain("sched_e2e_b"), 6, level=1, split="heldout", seed=5)
    suite_file = tmp_path / "guard_b.jsonl"
    suite_file.write_text("".join(json.dumps(task.to_dict()) + "\n" for task in items))

    def break_b(step, metrics):
        if step == 1:
            BROKEN.add("sched_e2e_b")

    def config(name, action):
        return recipe(policy_dir, tmp_path / name, domains=[{"name": "sched_e2e_a", "heldout": 0}],
                      train={"max_steps": 4, "eval_every": 2, "save_every": None},
                      schedule={"dynamic_sampling": {"mode": "keep"},
                                "guard": {"threshold": 0.1, "recover": 0.05, "replay_samples": 4, "replay_coef": 0.5,
                                          "action": action,
                                          "suites": [{"name": "b_items", "path": str(suite_file),
                                                      "domain": "sched_e2e_b", "levels": [1, 2]}]}})

    try:
        result = run_rl(config("both", "both"), on_step=break_b)
    finally:
        BROKEN.clear()
    regressions = [e for e in result.events if e["kind"] == "regression"]
    assert [(e["suite"], e["step"], e["value"], e["domain"]) for e in regressions] == [("b_items", 2, 0.0, None)]
    assert regressions[0]["actions"] == ["replay SFT"]  # b has no share in the mix to boost
    history = {int(m["policy/version"]): m for m in result.history}  # version = step - 1
    assert "guard/replay_samples" not in history[1] and history[2]["guard/replay_samples"] == 4
    assert history[2]["guard/replay_loss"] > 0 and history[2]["guard/replay_tokens"] > 0
    assert not any(k.startswith("mix/target/sched_e2e_b") for m in result.history for k in m)
    # every evaluation is recorded with its cost: the baseline, steps 2 and 4, and the final one
    assert [(e["step"], e.get("final", 0.0)) for e in result.evaluations] == [(0, 0.0), (2, 0.0), (4, 0.0), (4, 1.0)]
    assert [e["regression/b_items"] for e in result.evaluations] == [1.0, 0.0, 0.0, 0.0]
    assert all(e["seconds"] > 0 for e in result.evaluations)

    # The demonstrations replayed are b's (train split, at the suite's levels), not the file's items or a's.
    guard_config = config("unit", "both")
    guard = RunGuard(guard_config, regression_suites(guard_config))
    guard.after_eval(0, {"b_items": SuiteScore(pass_rate=1.0, episodes=6, infra_failures=0)})
    guard.after_eval(2, {"b_items": SuiteScore(pass_rate=0.0, episodes=6, infra_failures=0)})
    replayed = guard.replay_batch(2)
    assert len(replayed) == 4 and {sample.metadata.domain for sample in replayed} == {"sched_e2e_b"}
    assert all(split_of(sample.messages[0]["content"]) == "train" for sample in replayed)
    assert not {sample.messages[0]["content"] for sample in replayed} & {t.metadata["problem_key"] for t in items}
    # `weight` alone cannot help a domain outside the mix: the regression is logged, nothing replayed or boosted
    weight_only = config("weight", "weight")
    guard = RunGuard(weight_only, regression_suites(weight_only))
    guard.after_eval(0, {"b_items": SuiteScore(pass_rate=1.0, episodes=6, infra_failures=0)})
    assert guard.after_eval(2, {"b_items": SuiteScore(pass_rate=0.0, episodes=6, infra_failures=0)})[0][
        "actions"] == ["log"]
    assert guard.replay_batch(2) == [] and guard.forgetting.boosted_domains() == []


def test_an_alarm_rolls_back_to_the_last_good_checkpoint_and_lowers_the_lr(policy_dir, tmp_path, capsys):
    # spike_z = 0: any loss or gradient norm above its running mean is a "spike" once warm-up is over.
    config = recipe(policy_dir, tmp_path / "alarm", train={"max_steps": 6, "save_every": 2},
                    optim={"schedule": "constant"},
                    schedule={"dynamic_sampling": {"mode": "keep"},
                              "alarms": {"action": "rollback", "warmup_steps": 2, "spike_z": 0.0,
                                         "max_rollbacks": 1, "lr_decay": 0.5}})
    result = run_rl(config)
    rollbacks = [e for e in result.events if e["kind"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["lr_scale"] == 0.5
    alarm = next(e for e in result.events if e["kind"].endswith("_spike"))
    # back to the newest checkpoint saved before the alarm (every 2 steps, none saved at an alarm step)
    assert alarm["step"] == rollbacks[0]["step"] > 2 and rollbacks[0]["to_step"] == (alarm["step"] - 1) // 2 * 2
    versions = [int(m["policy/version"]) for m in result.history]
    again = next(i for i in range(1, len(versions)) if versions[i] <= versions[i - 1])
    assert versions[again] == rollbacks[0]["to_step"]  # the steps after the checkpoint are trained again
    assert all(m["train/lr"] == 1e-3 for m in result.history[:again])
    assert all(m["train/lr"] == 5e-4 for m in result.history[again:])
    assert result.history[-1]["guard/rollbacks"] == 1.0 and result.history[-1]["guard/lr_scale"] == 0.5
    assert result.steps == 6
    assert (f"rolled back to the checkpoint of step {rollbacks[0]['to_step']}, learning rate now x0.5"
            in capsys.readouterr().err.replace("\n", " "))
    logged = (tmp_path / "alarm" / "schedule_events.jsonl").read_text()
    assert '"kind": "rollback"' in logged


def test_a_rollback_lowers_the_critic_s_learning_rate_too(policy_dir, tmp_path):
    config = recipe(policy_dir, tmp_path / "ppo", train={"max_steps": 6, "save_every": 2},
                    optim={"schedule": "constant"}, algorithm={"advantage": "gae"},
                    schedule={"dynamic_sampling": {"mode": "keep"},
                              "alarms": {"action": "rollback", "warmup_steps": 2, "spike_z": 0.0,
                                         "max_rollbacks": 1, "lr_decay": 0.5}})
    result = run_rl(config)
    rollback = next(e for e in result.events if e["kind"] == "rollback")
    versions = [int(m["policy/version"]) for m in result.history]
    again = next(i for i in range(1, len(versions)) if versions[i] <= versions[i - 1])
    assert versions[again] == rollback["to_step"]
    base = result.history[0]["critic/lr"]
    assert all(m["critic/lr"] == base for m in result.history[:again])
    assert all(m["critic/lr"] == base * 0.5 for m in result.history[again:])
    assert all(m["train/lr"] == 5e-4 for m in result.history[again:])
