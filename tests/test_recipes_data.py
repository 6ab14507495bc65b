"""The packaged `sft-chat` and `dpo-pairs` recipes run as shipped, on the data samples in the package."""

from __future__ import annotations

import pytest

from posttrain.cli import packaged_recipe
from posttrain.config import DPORecipe, SFTRecipe, load_recipe
from posttrain.tracking import read_metrics
from posttrain.train.dpo import run_dpo
from posttrain.train.sft import run_sft

QUIET = ["tracking.progress=false", "tracking.tensorboard=false", "runtime.num_threads=1"]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r}


def test_sft_chat_reads_every_format_it_ships_and_trains(tmp_path):
    recipe = load_recipe(packaged_recipe("sft-chat"), [f"output_dir={tmp_path}", "train.max_steps=8",
                                                       "train.log_every=1", "model.preset=tiny-1m", *QUIET],
                         schema=SFTRecipe)
    result = run_sft(recipe)
    report = result.data_report
    assert report["read"] == {"posttrain:recipes/data/sft-chat/messages.jsonl": 160,
                              "posttrain:recipes/data/sft-chat/sharegpt.jsonl": 120,
                              "posttrain:recipes/data/sft-chat/alpaca.csv": 120}
    assert set(report["mixture"]["groups"]) == {"arithmetic", "strings", "sorting"}
    steps = losses(result.output_dir)
    assert result.steps == 8 and steps[8] < steps[1]
    assert (result.final_dir / "config.json").is_file()


def test_dpo_pairs_reads_explicit_and_implicit_pairs_and_trains(tmp_path):
    recipe = load_recipe(packaged_recipe("dpo-pairs"), [f"output_dir={tmp_path}", "train.max_steps=6",
                                                        "train.log_every=1", "model.preset=tiny-1m", *QUIET],
                         schema=DPORecipe)
    result = run_dpo(recipe)
    assert result.data_report["pairs"]["train"] + result.data_report["pairs"]["heldout"] == 350
    assert result.steps == 6 and result.train_loss < 0.6931  # below log 2: it prefers the chosen answers
    assert (result.final_dir / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # minutes on an idle 2-core machine; a loaded one took longer than 10
@pytest.mark.parametrize("name, schema, run", [("sft-chat", SFTRecipe, run_sft), ("dpo-pairs", DPORecipe, run_dpo)])
def test_packaged_recipe_runs_as_shipped(name, schema, run, tmp_path):
    result = run(load_recipe(packaged_recipe(name), [f"output_dir={tmp_path}", "tracking.progress=false"],
                             schema=schema))
    assert result.steps == load_recipe(packaged_recipe(name), schema=schema).train.max_steps
    if name == "sft-chat":
        heldout = [r["eval/heldout_loss"] for r in read_metrics(tmp_path / "metrics.jsonl") if "eval/heldout_loss" in r]
        assert result.heldout_loss is not None and result.heldout_loss < heldout[0]
    else:
        assert result.train_loss < 0.6931


def test_sft_chat_streaming_trains(tmp_path):
    overrides = ["data.streaming=true", "train.max_steps=4", "train.log_every=1", "train.save_every=2",
                 "model.preset=tiny-1m", *QUIET]
    recipe = load_recipe(packaged_recipe("sft-chat"), [f"output_dir={tmp_path}", *overrides], schema=SFTRecipe)
    result = run_sft(recipe)
    report = result.data_report
    assert report["streaming"] and report["read"]["posttrain:recipes/data/sft-chat/alpaca.csv"] == 120
    assert set(report["mix_rates"]) == {"arithmetic", "strings", "sorting"} and report["heldout"]["samples"] > 0
    assert result.steps == 4 and result.heldout_loss is not None
    steps = losses(result.output_dir)
    assert steps[4] < steps[1]
