"""Pinned figures of a short GRPO run (torchtune style): tiny-1m, fp32, one thread, fixed seeds.

A change that makes RL learn differently — slower, faster, or just other numbers (a loss term, the advantage
estimator, the sampler's seeds, the micro-batch order) — moves these figures and fails the test. A change that
is meant to move them is re-pinned deliberately: run

    PIN_PRINT=1 pytest -q -s tests/test_rl_pinned.py

which prints the measured figures in the form of `PINNED` below, paste them over it, and say in the commit why
they moved. Tolerances are tight (abs 1e-6 on the loss): on one thread, fp32, the run is deterministic on a
given machine; a different CPU's vector units may round differently and need a re-pin there.

On-policy GRPO's policy-gradient loss is ~0 by construction (ratio 1, advantages centred per group), so the
recipe adds a small entropy bonus: the loss then carries the policy's entropy, which moves with every update,
and the gradient norm is pinned beside it.

The domain is a test domain with a smooth reward (the share of digits in the completion): a freshly built model
gets no exact arithmetic answer right, so an arithmetic run would pin zeros; this one learns from step 1.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from posttrain.config import load_recipe
from posttrain.config.rl import RLRecipe
from posttrain.models import build_tiny_model, save_model_dir
from posttrain.rl import run_rl
from posttrain.tasks import domain
from posttrain.tasks.base import task_id
from posttrain.types import Reward, Task
from posttrain.verify import verifier

# step -> (train/loss, reward/mean, train/grad_norm), measured on the development machine (x86-64, 1 thread, fp32)
PINNED: dict[int, tuple[float, float, float]] = {
    1: (-0.05728176, 0.040179, 3.203447),
    2: (-0.05723048, 0.035714, 2.150570),
    3: (-0.05718036, 0.045139, 1.874546),
    4: (-0.05715112, 0.015625, 1.743643),
    5: (-0.05713899, 0.044118, 1.815331),
    6: (-0.05712357, 0.087798, 1.753115),
    7: (-0.05711971, 0.000000, 0.002454),
    8: (-0.05711136, 0.061920, 1.581365),
}
LOSS_TOLERANCE = 1e-6  # the entropy bonus moves the loss by ~2e-5 a step: 1e-4 would not see a change
REWARD_TOLERANCE = 1e-5  # a mean of verifier scores over 16 episodes: exact unless a sample changes


@verifier("pinned_digit_share")
def digit_share(completion: str, *, final_state=None) -> Reward:
    text = completion.strip()
    score = sum(ch.isdigit() for ch in text) / max(len(text), 1)
    return Reward(score=score, passed=score > 0.5)


@domain("pinned_digits")
class PinnedDigits:
    name = "pinned_digits"
    max_level = 1

    def make_task(self, rng: random.Random, level: int) -> Task:
        key = f"{rng.randrange(100)}+{rng.randrange(100)}"
        return Task(id=task_id(self.name, key), domain=self.name, messages=[{"role": "user", "content": key}],
                    verifier="pinned_digit_share", metadata={"problem_key": key})

    def demonstration(self, task):  # pragma: no cover - not used
        raise NotImplementedError


@pytest.fixture()
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pinned_recipe(policy_dir, output) -> RLRecipe:
    return RLRecipe.model_validate({
        "output_dir": str(output),
        "model": {"path": str(policy_dir)},
        "domains": [{"name": "pinned_digits", "heldout": 0}],
        "rollout": {"prompts_per_step": 4, "sampling": {"group_size": 4, "max_new_tokens": 8}},
        "algorithm": {"advantage": "grpo", "entropy_coef": 0.01},
        "optim": {"lr": 1e-3},
        "train": {"max_steps": 8, "micro_batch_size": 8},
        "pipeline": {"self_test": False, "max_staleness": 0},
        "runtime": {"precision": "fp32", "device": "cpu", "num_threads": 1, "seed": 0},
        "tracking": {"tensorboard": False, "progress": False},
    })


def test_grpo_figures_are_pinned(tmp_path, tiny_tokenizer, one_thread):
    policy_dir = tmp_path / "policy"
    save_model_dir(policy_dir, build_tiny_model("tiny-1m", tiny_tokenizer, seed=0), tiny_tokenizer)
    result = run_rl(pinned_recipe(policy_dir, tmp_path / "rl"))
    measured = {step: (m["train/loss"], m["reward/mean"], m["train/grad_norm"])
                for step, m in enumerate(result.history, start=1)}
    if os.environ.get("PIN_PRINT"):
        print("PINNED = {\n" + "".join(f"    {s}: ({l:.8f}, {r:.6f}, {g:.6f}),\n" for s, (l, r, g) in measured.items())
              + "}")
    assert sorted(measured) == sorted(PINNED)
    for step, (loss, reward, grad_norm) in PINNED.items():
        assert measured[step][0] == pytest.approx(loss, abs=LOSS_TOLERANCE), f"train/loss at step {step}"
        assert measured[step][1] == pytest.approx(reward, abs=REWARD_TOLERANCE), f"reward/mean at step {step}"
        assert measured[step][2] == pytest.approx(grad_norm, rel=1e-3), f"train/grad_norm at step {step}"


def test_an_rl_recipe_loads_through_the_library(tmp_path):
    """`load_recipe(path)` picks the RL schema from `stage: rl` with nothing but `posttrain.config` imported."""
    import subprocess
    import sys

    path = tmp_path / "rl.yaml"
    path.write_text("stage: rl\nmodel: {path: runs/sft/final}\ntrain: {max_steps: 3}\n")
    code = ("import sys; from posttrain.config import load_recipe; r = load_recipe(sys.argv[1]); "
            "print(type(r).__name__, r.train.max_steps, 'posttrain.rl' in sys.modules, 'posttrain.cli' in sys.modules)")
    # A fresh interpreter: in this one the test modules have imported the RL recipe already.
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["RLRecipe", "3", "False", "False"]
    assert type(load_recipe(path)) is RLRecipe
