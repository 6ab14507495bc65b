"""The packaged GRPO recipes run as they are on the built-in tiny model with their shipped data; the CLI's
`validate`, `recipes --copy` and `--version`.

The fast variants (one step, small groups, via overrides) are in the default suite; the full runs are slow-marked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from posttrain.cli import main

FAST = ["train.max_steps=1", "rollout.prompts_per_step=2", "rollout.sampling.group_size=2",
        "rollout.sampling.max_new_tokens=16", "model.preset=tiny-1m", "runtime.num_threads=1"]
TERMS = {"grpo-math": {"correct", "brevity"}, "grpo-code": {"tests", "brevity"},
         "grpo-agent": {"correct", "tool_use"}}
# The verifier term of each recipe (the other term is a reward function) and the verifier that judges it.
VERIFIER = {"grpo-math": ("correct", "math"), "grpo-code": ("tests", "code"), "grpo-agent": ("correct", "exact")}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check_run(name: str, output: Path, steps: int) -> list[dict]:
    metrics = [m for m in _records(output / "metrics.jsonl") if any(k.startswith("reward/") for k in m)]
    assert len([m for m in metrics if "reward/mean" in m]) == steps
    for term in TERMS[name]:
        assert all(f"reward/{term}" in m for m in metrics if "reward/mean" in m), term  # each term logged
    episodes = _records(output / "episodes.jsonl")
    assert episodes and all(set(e["details"]["weights"]) == TERMS[name] for e in episodes)
    term, verifier = VERIFIER[name]
    assert all(e["details"][term].get("verifier") == verifier for e in episodes)
    assert (output / "final" / "config.json").is_file()
    return episodes


@pytest.mark.parametrize("name", ["grpo-math", pytest.param("grpo-code", marks=pytest.mark.bwrap), "grpo-agent"])
def test_grpo_recipe_fast(tmp_path, name, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipe finds its data and reward code beside itself, from anywhere
    assert main(["rl", name, *FAST, f"output_dir={tmp_path / 'run'}"]) == 0
    _check_run(name, tmp_path / "run", steps=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo-math", "grpo-code", "grpo-agent"])
def test_grpo_recipe_full(tmp_path, name):
    assert main(["rl", name, f"output_dir={tmp_path / 'run'}"]) == 0
    _check_run(name, tmp_path / "run", steps=20)


@pytest.mark.slow
@pytest.mark.bwrap
@pytest.mark.timeout(1800)
def test_grpo_code_from_a_model_that_writes_code_is_judged_in_the_sandbox(tmp_path):
    """A tiny model fine-tuned on the shipped solutions writes code blocks, which the sandbox runs."""
    from posttrain.tasks import get_domain

    recipes = Path(__file__).resolve().parents[1] / "src" / "posttrain" / "recipes"
    domain = get_domain("tasks", kind="code", path=str(recipes / "data" / "tasks-code.jsonl"))
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps({"messages": domain.demonstration(t).messages}) + "\n"
                             for t in domain.tasks() for _ in range(16)))
    sft = {"stage": "sft", "output_dir": str(tmp_path / "sft"), "model": {"preset": "tiny-3m"},
           "data": {"train": [{"path": str(demos)}], "max_length": 256, "dedup": {"exact": False}},
           "optim": {"lr": 3e-3}, "train": {"batch_size": 16, "max_steps": 60},
           "tracking": {"tensorboard": False, "progress": False}}
    (tmp_path / "sft.yaml").write_text(json.dumps(sft))
    assert main(["sft", str(tmp_path / "sft.yaml")]) == 0
    assert main(["rl", "grpo-code", f"model.path={tmp_path / 'sft' / 'final'}", "train.max_steps=1",
                 "rollout.sampling.max_new_tokens=96", "rollout.sampling.temperature=0.3",
                 f"output_dir={tmp_path / 'rl'}"]) == 0
    episodes = _check_run("grpo-code", tmp_path / "rl", steps=1)
    ran = [e for e in episodes if "duration_s" in e["details"]["tests"]]  # the jail ran the program
    assert ran and any(e["details"]["tests"].get("status") == "ok" for e in ran)
    assert any(e["passed"] for e in episodes)


def test_validate_an_rl_recipe_counts_tasks_and_shows_the_prompt(capsys):
    assert main(["validate", "grpo-math", "model.preset=tiny-1m"]) == 0
    out = capsys.readouterr().out
    assert "a valid 'rl' recipe" in out and "domain tasks: 40 tasks (level 1:" in out
    assert "reward term brevity: weight 0.1, function " in out and "[[...]]" in out
    assert "estimate: 20 steps x 4 prompts x 4 completions = 320 episodes" in out
    assert "nothing was trained" in out


def test_validate_an_sft_recipe_marks_the_loss_mask(tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(f"stage: sft\noutput_dir: {tmp_path / 'run'}\nmodel: {{preset: tiny-1m}}\n"
                      f"data: {{train: [{{path: {data}}}], max_length: 64, pack: false}}\n"
                      "train: {batch_size: 8, epochs: 2}\n")
    assert main(["validate", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "data: 40 records read, 40 train / 0 held-out samples" in out
    sample = out.split("trained]]):\n", 1)[1].splitlines()[0]
    assert "<|user|>What is" in sample and "[[It is" in sample  # the prompt is context, the answer trained
    assert sample.index("<|user|>") < sample.index("[[")
    assert "estimate: 10 steps" in out and not (tmp_path / "run").exists()
    assert main(["validate", str(recipe), "data.streaming=true"]) == 0  # a streamed epoch is read by slices
    streamed = capsys.readouterr().out
    assert "data: streamed, " in streamed and "one packed row (" in streamed and "[[It is" in streamed
    assert main(["validate", str(recipe), "train.batch_size=many"]) == 2
    err = capsys.readouterr().err.strip()
    assert "train.batch_size: expected an integer, got 'many'" in err and "\n" not in err


def test_recipes_copy_and_version(tmp_path, capsys, monkeypatch):
    assert main(["recipes", "grpo-agent", "--copy", str(tmp_path / "mine")]) == 0
    copied = sorted(str(p.relative_to(tmp_path / "mine")) for p in (tmp_path / "mine").rglob("*") if p.is_file())
    assert copied == ["grpo-agent.yaml", "grpo_rewards.py"]
    assert main(["recipes", "grpo-math", "--copy", str(tmp_path / "mine")]) == 0
    assert (tmp_path / "mine" / "data" / "tasks-math.jsonl").is_file()
    # The copy is self-contained: edit its reward file, and the run reads the copy, not the package.
    monkeypatch.chdir(tmp_path)
    from posttrain.config import load_recipe

    recipe = load_recipe(tmp_path / "mine" / "grpo-math.yaml")
    assert recipe.rewards[1].function == f"{tmp_path / 'mine'}/grpo_rewards.py:brevity"
    assert recipe.domains[0].args["path"] == f"{tmp_path / 'mine'}/data/tasks-math.jsonl"
    capsys.readouterr()
    assert main(["recipes", "grpo-math", "--copy", str(tmp_path / "mine")]) == 2
    assert "exists already" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    from posttrain import __version__

    assert capsys.readouterr().out.strip() == f"posttrain {__version__}"
    assert main(["recipes"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in TERMS)
    assert "grpo_rewards" not in listing and os.sep + "data" not in listing


def test_validate_a_dpo_recipe_and_a_model_directory(tmp_path, capsys, policy_dir):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+{i}="}],
                                         "chosen": [{"role": "assistant", "content": str(2 * i)}],
                                         "rejected": [{"role": "assistant", "content": str(2 * i + 1)}]}) + "\n"
                             for i in range(30)))
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text(f"stage: dpo\nmodel: {{path: {policy_dir}}}\ndata: {{train: [{{path: {pairs}}}], "
                      "max_length: 64}\ntrain: {batch_size: 8, epochs: 1}\n")
    assert main(["validate", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert f"model: {policy_dir} (llama, " in out and "parameters)" in out
    assert "data: 30 train / 0 held-out preference pairs" in out
    assert "<|user|>0+0=<|end|><|assistant|>[[0<|end|>]]" in out
    assert "estimate: 4 steps (batch 8 pairs: 1.00 epochs)" in out
