"""The demo pipeline (`posttrain demo`) at toy scale: its data hygiene, and every stage end to end."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from posttrain.config import ConfigError, load_recipe
from posttrain.config.demo import DemoRecipe
from posttrain.demo import run_demo


def toy_recipe(tmp_path, stages: str, extra: list[str] | None = None) -> DemoRecipe:
    path = tmp_path / "demo.yaml"
    path.write_text(f"""\
stage: demo
output_dir: {tmp_path / 'run'}
preset: tiny-1m
vocab_size: 320
stages: {stages}
domains:
  - {{name: arithmetic, args: {{operators: "+"}}, sft_levels: [1, 2], demos: 300, level_demos: {{3: 25}},
     heldout_levels: [2, 3], heldout: 40, validation: 10}}
  - {{name: calculator, sft_levels: [1], demos: 40, heldout_levels: [1], heldout: 8, validation: 0}}
sft:
  data: {{max_length: 96}}
  optim: {{lr: 2.0e-3, warmup_steps: 2}}
  train: {{batch_size: 16, max_steps: 6, log_every: 3}}
dpo_pairs: {{prompts: 16, samples: 2, per_task: 1}}
dpo:
  train: {{batch_size: 4, epochs: 1}}
rl:
  domains:
    - {{name: arithmetic, args: {{operators: "+"}}, levels: [3], heldout: 0}}
    - {{name: calculator, levels: [1], heldout: 0}}
  rollout: {{prompts_per_step: 4, sampling: {{group_size: 4, max_new_tokens: 24}}}}
  train: {{max_steps: 2, micro_batch_size: 16}}
eval: {{max_new_tokens: 24, batch_size: 32}}
""")
    return load_recipe(path, extra or [], DemoRecipe)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_base_stage_keeps_heldout_items_out_of_the_demonstrations(tmp_path):
    summary = run_demo(toy_recipe(tmp_path, "[]"))
    data = tmp_path / "run" / "data"
    demos = read_jsonl(data / "sft_train.jsonl")
    arithmetic = [d for d in demos if d["metadata"]["domain"] == "arithmetic"]
    assert len(arithmetic) == 325 and summary["stages"]["base"]["demonstrations"]["arithmetic"] == 325
    assert Counter(d["metadata"]["difficulty"] for d in arithmetic)[3] == 25  # the few hard demonstrations

    def questions(records):  # the first user turn: the problem itself
        return {next(m["content"] for m in r["messages"] if m["role"] == "user") for r in records}

    trained = questions(demos)
    for name in ("arithmetic", "calculator"):
        test = questions(read_jsonl(data / f"heldout_{name}.jsonl"))
        validation = questions(read_jsonl(data / f"validation_{name}.jsonl"))
        assert test and not test & trained, name
        assert not validation & test and not validation & trained, name
    assert {t["difficulty"] for t in read_jsonl(data / "heldout_arithmetic.jsonl")} == {2, 3}


def test_level_demos_may_not_repeat_the_spread_levels(tmp_path):
    with pytest.raises(ConfigError, match=r"level_demos: levels \[2\] are in sft_levels"):
        toy_recipe(tmp_path, "[]", ["domains.0.level_demos={2: 5}"])


def test_every_stage_runs_records_its_figures_and_resumes(tmp_path):
    recipe = toy_recipe(tmp_path, "[sft, dpo, rl, sft_control, report]")
    summary = run_demo(recipe)
    stages = summary["stages"]
    trained = ["sft", "rl", "sft_control"]
    # Six SFT steps solve none of the sampled tasks (seeded: the same on every machine): no success/failure pair,
    # so DPO says so, writes no (empty) pairs file, and RL starts from SFT. (`make demo` takes the other branch.)
    assert stages["dpo"]["pairs"] == 0 and stages["dpo"]["sampled_pass_rate"] == 0.0
    assert stages["dpo"]["skipped"] and not (tmp_path / "run" / "dpo" / "final").exists()
    assert not (tmp_path / "run" / "data" / "dpo_pairs.jsonl").exists()
    for stage in trained:
        assert set(stages[stage]["heldout"]) == {"arithmetic", "calculator"}, stage
        assert all(0.0 <= v <= 1.0 for v in stages[stage]["heldout"].values())
        assert (tmp_path / "run" / stage / "final" / "config.json").is_file()
    assert stages["rl"]["steps"] == 2 and stages["rl"]["started_from"] == "sft"
    assert stages["sft_control"]["seconds"] > 0
    assert (tmp_path / "run" / "report.html").is_file()
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary
    again = run_demo(recipe, resume=True)  # every stage finished: nothing runs twice
    assert again == summary
