"""Each of the five packaged recipes a new user starts from (docs/recipes.md) runs as shipped — its own model
settings, batch, group sizes and packaged sample data — for a few steps, through the CLI. Slow-marked: the
fast variants (shrunk groups, one step) are in tests/test_recipes_grpo.py and tests/test_recipes_data.py, the
whole runs beside them."""

from __future__ import annotations

import json
import math

import pytest

from posttrain.cli import main

STEPS = 3


@pytest.mark.slow
@pytest.mark.timeout(1800)  # under a load of 10-15 on 2 cores a GRPO step with the shipped groups takes minutes
@pytest.mark.parametrize("stage, name", [
    ("sft", "sft-chat"), ("dpo", "dpo-pairs"), ("rl", "grpo-math"),
    pytest.param("rl", "grpo-code", marks=pytest.mark.bwrap), ("rl", "grpo-agent"),
])
def test_packaged_recipe_runs_a_few_steps_as_shipped(tmp_path, monkeypatch, stage, name):
    monkeypatch.chdir(tmp_path)  # the recipe finds its data (and reward code) beside itself, from anywhere
    run = tmp_path / "run"
    assert main([stage, name, f"train.max_steps={STEPS}", f"output_dir={run}", "tracking.progress=false",
                 "runtime.num_threads=1"]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    key = "reward/mean" if stage == "rl" else "train/loss"
    logged = [m for m in metrics if key in m]
    assert logged and logged[-1]["step"] == STEPS and all(math.isfinite(m[key]) for m in logged)  # to the end
    if stage == "rl":
        assert len(logged) == STEPS
    assert (run / "final" / "config.json").is_file()
