"""SFT's console: the validation accuracy at every evaluation, and at the end why training stopped with the
accuracy it reached (early stopping, epochs, max_steps, or the time cap, which warns)."""

from __future__ import annotations

import re

from test_sft import data_file, write_recipe  # noqa: F401  (data_file is a fixture)

from posttrain.config import SFTRecipe, load_recipe
from posttrain.train.sft import run_sft


def scripted(scores):
    """An evaluate callback with a scripted accuracy per call (two domains), counting its calls."""
    scores = iter(scores)
    calls = []

    def evaluate(model):
        score = next(scores)
        calls.append(score)
        return {"score": score, "accuracy/arithmetic": score, "accuracy/code": score / 2}

    return evaluate, calls


def stop_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("[sft] stopped:")]


def test_each_evaluation_prints_the_validation_accuracy_and_early_stopping_says_so(tmp_path, data_file, capsys):
    evaluate, calls = scripted([0.25, 0.5, 0.375, 0.4, 0.45])
    recipe = load_recipe(write_recipe(tmp_path, data_file, data={"heldout_fraction": 0.0}, train={
        "max_steps": 20, "eval_every": 2, "early_stopping_patience": 3}), schema=SFTRecipe)
    result = run_sft(recipe, evaluate=evaluate)
    err = capsys.readouterr().err
    assert result.stopped_by == "early_stopping" and result.steps == 10 and len(calls) == 5  # no extra evaluation
    assert "[sft] step 2: validation accuracy 25.0% (arithmetic 25.0%, code 12.5%) (best 25.0% at step 2)" in err
    assert "[sft] step 8: validation accuracy 40.0% (arithmetic 40.0%, code 20.0%) (best 50.0% at step 4)" in err
    [line] = stop_lines(err)
    assert line.startswith("[sft] stopped: early stopping, at step 10 of 20 planned; validation accuracy 45.0%")
    assert line.endswith("an earlier evaluation was better: 50.0% at step 4")
    assert result.evaluation["eval/score"] == 0.45


def test_a_run_that_ends_between_evaluations_is_evaluated_once_more_at_its_last_step(tmp_path, data_file, capsys):
    evaluate, calls = scripted([0.25, 0.5, 0.75])
    recipe = load_recipe(write_recipe(tmp_path, data_file, data={"heldout_fraction": 0.0},
                                      train={"max_steps": 5, "eval_every": 2}), schema=SFTRecipe)
    result = run_sft(recipe, evaluate=evaluate)
    err = capsys.readouterr().err
    assert result.stopped_by == "max_steps" and result.steps == 5 and len(calls) == 3
    assert "[sft] step 5 (end): validation accuracy 75.0%" in err
    [line] = stop_lines(err)
    assert line.startswith("[sft] stopped: train.max_steps reached, at step 5 of 5 planned; validation accuracy 75.0%")
    assert "earlier" not in line  # the last evaluation is the best: nothing better to point back to
    assert result.evaluation["eval/score"] == 0.75


def test_epochs_and_the_time_cap_are_named_and_the_cap_warns(tmp_path, data_file, capsys):
    recipe = load_recipe(write_recipe(tmp_path, data_file, train={"max_steps": None, "epochs": 1, "eval_every": 0}),
                         schema=SFTRecipe)
    result = run_sft(recipe)
    [line] = stop_lines(capsys.readouterr().err)
    planned = int(re.search(r"of (\d+) planned", line).group(1))
    assert result.stopped_by == "epochs" and result.steps == planned
    assert line.startswith(f"[sft] stopped: all 1 epochs done, at step {planned} of {planned} planned; held-out loss")

    evaluate, _ = scripted([0.3])
    (tmp_path / "capped").mkdir()
    recipe = load_recipe(write_recipe(tmp_path / "capped", data_file, train={
        "max_steps": 50, "max_minutes": 1e-6, "eval_every": 10}), schema=SFTRecipe)
    result = run_sft(recipe, evaluate=evaluate)
    err = capsys.readouterr().err
    assert result.stopped_by == "time_cap" and result.steps == 1
    assert "WARNING: the time cap of 1e-06 min cut training short at step 1 of 50" in err
    [line] = stop_lines(err)
    assert "the time cap of 1e-06 min cut it short (WARNING" in line and "validation accuracy 30.0%" in line
