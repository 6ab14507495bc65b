"""The SFT recipe end to end: it learns, resumes exactly after SIGKILL, and bad input is one clear line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.config import SFTRecipe, load_recipe
from posttrain.data import prepare_sft_data
from posttrain.tasks import get_domain, sample_tasks
from posttrain.tracking import read_metrics
from posttrain.train import EarlierRunError, setup_runtime
from posttrain.train.sft import evaluate_loss, run_sft


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    domain = get_domain("arithmetic")
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with open(path, "w") as handle:
        for task in sample_tasks(domain, 600, level=[2, 3], seed=0):
            handle.write(json.dumps(domain.demonstration(task).to_dict()) + "\n")
    return path


def write_recipe(tmp_path: Path, data_file: Path, **sections) -> Path:
    recipe = {
        "stage": "sft",
        "output_dir": str(tmp_path / "run"),
        "model": {"preset": "tiny-1m"},
        "data": {"train": [{"path": str(data_file)}], "heldout_fraction": 0.05, "max_length": 128},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {"batch_size": 16, "max_steps": 8, "log_every": 1},
        "runtime": {"precision": "fp32", "num_threads": 1},
        "tracking": {"tensorboard": False, "progress": False},
    }
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def step_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r}


def test_sft_learns_and_writes_a_plain_hf_model(tmp_path, data_file):
    recipe = load_recipe(write_recipe(tmp_path, data_file, train={"max_steps": 25}), schema=SFTRecipe)
    result = run_sft(recipe)
    losses = step_losses(result.output_dir)
    assert losses[25] < losses[1] * 0.6
    assert result.heldout_loss is not None and result.heldout_loss < losses[1]
    # The saved directory is the trained model: plain transformers loads it, and its held-out loss is the run's.
    model = AutoModelForCausalLM.from_pretrained(result.final_dir)
    tokenizer = AutoTokenizer.from_pretrained(result.final_dir)
    data = prepare_sft_data(recipe.data, tokenizer, seed=recipe.runtime.seed, rejects_dir=tmp_path)
    runtime = setup_runtime(recipe.runtime)
    reloaded = evaluate_loss(model, data.heldout_rows(), tokenizer.pad_token_id, runtime, recipe.train.batch_size)
    assert reloaded == pytest.approx(result.heldout_loss, abs=1e-5)
    assert (result.output_dir / "tensorboard").exists() is False  # tensorboard off in this recipe
    assert (result.output_dir / "recipe.yaml").is_file()


def test_resume_after_sigkill_continues_exactly(tmp_path, data_file):
    reference_dir, crash_dir = tmp_path / "reference", tmp_path / "crash"
    reference_dir.mkdir()
    crash_dir.mkdir()
    reference = write_recipe(reference_dir, data_file, train={"save_every": 3, "max_steps": 8})
    crashing = write_recipe(crash_dir, data_file, train={"save_every": 3, "max_steps": 8})
    command = [sys.executable, "-m", "posttrain.cli", "sft"]
    subprocess.run([*command, str(reference)], check=True, capture_output=True)

    process = subprocess.Popen([*command, str(crashing)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = crash_dir / "run" / "checkpoints" / "step-000003"
    deadline = time.monotonic() + 300
    while not (checkpoint / "training_state.pt").exists() and process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not (crash_dir / "run" / "final").exists()  # it really died mid-run

    resumed = subprocess.run([*command, str(crashing), "--resume"], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    expected, got = step_losses(reference_dir / "run"), step_losses(crash_dir / "run")
    assert sorted(got) == sorted(expected) == list(range(1, 9))
    for step in range(4, 9):
        assert got[step] == pytest.approx(expected[step], abs=1e-6), step


def test_a_fresh_run_where_an_earlier_one_is_refuses_before_writing_anything(tmp_path, data_file):
    """A second run without --resume in the same output_dir replaced the first's final model and, one
    checkpoint at a time, its checkpoints (and appended to its metrics): a forgotten --resume cost the run."""
    recipe = load_recipe(write_recipe(tmp_path, data_file, train={"max_steps": 4, "save_every": 2}), schema=SFTRecipe)
    first = run_sft(recipe)
    files = {path: path.read_bytes() for path in first.output_dir.rglob("*") if path.is_file()}
    again = recipe.model_copy(update={"optim": recipe.optim.model_copy(update={"lr": 1e-4})})
    with pytest.raises(EarlierRunError, match=r"holds an earlier run \(checkpoints up to step-000004\).*--resume"):
        run_sft(again)
    assert {path: path.read_bytes() for path in first.output_dir.rglob("*") if path.is_file()} == files
    for what in ("checkpoints", "final"):  # a run that kept only its final model, or only its checkpoints
        moved = tmp_path / "aside"
        (first.output_dir / what).rename(moved)
        with pytest.raises(EarlierRunError, match="holds an earlier run"):
            run_sft(again)
        moved.rename(first.output_dir / what)
    assert run_sft(again, resume=True).steps == 4  # --resume continues it (here: already finished)
    assert run_sft(again.model_copy(update={"output_dir": str(tmp_path / "new")})).steps == 4


def test_a_fresh_run_moves_aside_the_metrics_of_an_earlier_run_that_saved_no_checkpoint(tmp_path, data_file):
    """A run that died before its first checkpoint leaves metrics.jsonl: a fresh run appended to it, and the curves
    showed the dead run's steps past the new run's last. They move whole to earlier-<n>/; nothing is deleted."""
    recipe = load_recipe(write_recipe(tmp_path, data_file, train={"max_steps": 6, "save_every": 100},
                                      tracking={"tensorboard": True}), schema=SFTRecipe)
    first = run_sft(recipe)

    def die_before_a_checkpoint():  # as if the run had died at its last step, before saving
        for saved in ("final", "checkpoints"):
            shutil.rmtree(first.output_dir / saved, ignore_errors=True)

    die_before_a_checkpoint()
    dead = (first.output_dir / "metrics.jsonl").read_bytes()
    short = recipe.model_copy(update={"train": recipe.train.model_copy(update={"max_steps": 3})})
    assert run_sft(short).steps == 3
    assert sorted(step_losses(first.output_dir)) == [1, 2, 3]  # not the dead run's steps 4-6
    assert (first.output_dir / "earlier-1" / "metrics.jsonl").read_bytes() == dead
    assert any((first.output_dir / "earlier-1" / "tensorboard").iterdir())
    die_before_a_checkpoint()
    run_sft(short)
    assert sorted(p.name for p in first.output_dir.glob("earlier-*")) == ["earlier-1", "earlier-2"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain.cli", *args], capture_output=True, text=True)


def test_bad_input_is_one_line_with_file_line_and_field(tmp_path, data_file):
    broken = tmp_path / "broken.jsonl"
    lines = data_file.read_text().splitlines()[:5]
    record = json.loads(lines[2])
    record["messages"][0]["role"] = "bot"
    lines[2] = json.dumps(record)
    lines.insert(4, "{not json")
    broken.write_text("\n".join(lines) + "\n")
    result = run_cli("sft", str(write_recipe(tmp_path, broken)))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert f"{broken}:3: messages[0].role: expected one of system, user, assistant, tool, got 'bot'" in result.stderr

    missing = run_cli("sft", str(write_recipe(tmp_path, tmp_path / "nowhere.jsonl")))
    assert missing.returncode == 2 and "nowhere.jsonl" in missing.stderr and "Traceback" not in missing.stderr

    no_model = run_cli("sft", str(write_recipe(tmp_path, data_file)), f"model.path={tmp_path / 'no-model'}")
    assert no_model.returncode == 2 and "model.path" in no_model.stderr and "not a local directory" in no_model.stderr

    debug = run_cli("--debug", "sft", str(write_recipe(tmp_path, tmp_path / "nowhere.jsonl")))
    assert "Traceback" in debug.stderr


def test_skip_invalid_records_writes_rejects_and_keeps_going(tmp_path, data_file):
    broken = tmp_path / "broken.jsonl"
    broken.write_text(data_file.read_text() + '{"messages": []}\n')
    recipe = load_recipe(write_recipe(tmp_path, broken, data={"on_invalid": "skip"}, train={"max_steps": 1}),
                         schema=SFTRecipe)
    result = run_sft(recipe)
    rejects = (result.output_dir / "rejects.jsonl").read_text().splitlines()
    assert len(rejects) == 1 and json.loads(rejects[0])["line"] == 601
    assert result.data_report["rejected"] == 1


def test_lora_sft_saves_a_merged_plain_model(tmp_path, data_file):
    recipe = load_recipe(write_recipe(tmp_path, data_file, model={"lora": {"enabled": True, "r": 4}},
                                      train={"max_steps": 3, "save_every": 2}), schema=SFTRecipe)
    result = run_sft(recipe)
    assert not (result.final_dir / "adapter_config.json").exists()
    checkpoint = result.output_dir / "checkpoints" / "step-000003"
    assert (checkpoint / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(result.final_dir)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    # the adapter is folded in: the final weights are the last checkpoint's merged ones, and not the base's
    final = load_file(str(result.final_dir / "model.safetensors"))
    last = load_file(str(checkpoint / "model.safetensors"))
    assert final.keys() == last.keys() and all(torch.equal(final[k], last[k]) for k in final)
    first = load_file(str(result.output_dir / "checkpoints" / "step-000002" / "model.safetensors"))
    assert any(not torch.equal(final[k], first[k]) for k in final)


def test_lora_without_merge_on_save_keeps_the_adapter_and_export_merges_it(tmp_path, data_file):
    recipe = load_recipe(write_recipe(tmp_path, data_file, model={"lora": {"enabled": True, "r": 4,
                                                                           "merge_on_save": False}},
                                      train={"max_steps": 2}), schema=SFTRecipe)
    result = run_sft(recipe)
    assert (result.final_dir / "adapter_config.json").is_file()  # the adapter alone, as asked
    assert not (result.final_dir / "model.safetensors").exists()

    exported = run_cli("export", str(result.output_dir), str(tmp_path / "export"), "--dtype", "bfloat16")
    assert exported.returncode == 0, exported.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert model.dtype == torch.bfloat16 and not any("lora" in n for n, _ in model.named_parameters())
    weights = load_file(str(tmp_path / "export" / "model.safetensors"))
    merged = load_file(str(result.output_dir / "checkpoints" / "step-000002" / "model.safetensors"))
    assert weights.keys() == merged.keys()
    for key in weights:
        assert weights[key].dtype == torch.bfloat16
        torch.testing.assert_close(weights[key], merged[key].to(torch.bfloat16), rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(tmp_path / "export").get_vocab() == AutoTokenizer.from_pretrained(
        result.final_dir).get_vocab()

    nowhere = run_cli("export", str(tmp_path / "nowhere"), str(tmp_path / "x"))
    assert nowhere.returncode == 2 and "nowhere: no such directory" in nowhere.stderr


def test_activation_checkpointing_and_accumulation_keep_the_loss(tmp_path, data_file):
    """Recomputing activations, or splitting the batch into micro-batches, changes nothing but memory."""
    figures = []
    for name, extra in [("plain", {}), ("ckpt", {"runtime": {"activation_checkpointing": True}}),
                        ("micro", {"train": {"micro_batch_size": 4}})]:
        (tmp_path / name).mkdir()
        sections = {"train": {"max_steps": 3}}
        for key, value in extra.items():
            sections[key] = {**sections.get(key, {}), **value}
        result = run_sft(load_recipe(write_recipe(tmp_path / name, data_file, **sections), schema=SFTRecipe))
        figures.append(step_losses(result.output_dir))
    for other in figures[1:]:
        for step in (1, 2, 3):
            assert other[step] == pytest.approx(figures[0][step], abs=1e-5)


def test_early_stopping_on_the_evaluators_score(tmp_path, data_file):
    scores = iter([0.5, 0.7, 0.6, 0.65, 0.69, 0.9])  # best at the 2nd evaluation, then 3 without improvement
    calls = []

    def evaluate(model):
        calls.append(model.training)
        return {"score": next(scores)}

    recipe = load_recipe(write_recipe(tmp_path, data_file, train={
        "max_steps": 20, "eval_every": 2, "early_stopping_patience": 3}), schema=SFTRecipe)
    result = run_sft(recipe, evaluate=evaluate)
    assert result.steps == 10 and len(calls) == 5
    evals = [r for r in read_metrics(result.output_dir / "metrics.jsonl") if "eval/score" in r]
    assert [r["eval/score"] for r in evals] == [0.5, 0.7, 0.6, 0.65, 0.69]
