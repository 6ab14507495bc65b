"""The packaged `long-context` recipe: it validates (with `model.rope_scaling` extending the model to 8,192
positions), and its tasks are measured in the tokens of the tokenizer its own `base` stage trains, within the
8,192 positions it extends the model to; `posttrain demo --recipe` runs a demo-stage recipe file."""

from __future__ import annotations

import json

import pytest

from posttrain.cli import packaged_recipe
from posttrain.config import DemoRecipe, load_recipe


def _recipe(tmp_path, *overrides) -> DemoRecipe:
    return load_recipe(packaged_recipe("long-context"), [f"output_dir={tmp_path / 'run'}", *overrides], DemoRecipe)


def test_the_recipe_validates_with_its_rope_scaling(tmp_path):
    recipe = _recipe(tmp_path)
    scaling = recipe.sft.model.rope_scaling
    assert scaling is not None and scaling.factor == 8.0
    assert recipe.stages == ["sft", "rl", "report"] and recipe.sft.data.max_length == 8192
    assert [d.name for d in recipe.domains] == ["needle", "multi_doc_qa", "long_doc_qa"]


@pytest.mark.slow  # ~70 s here: the tokenizer is trained on a few hundred thousand tokens of long prompts
def test_the_base_stage_tasks_fit_8k_positions_in_its_own_tokenizer(tmp_path):
    from posttrain.demo.base import base
    from posttrain.demo.pipeline import DemoRun
    from posttrain.models import load_tokenizer
    from posttrain.config import ModelConfig as Model

    # The recipe's domains and levels at a few items each: the tokenizer is trained on that text like the real run.
    overrides = []
    for index, demos in enumerate((60, 30, 20)):
        overrides += [f"domains.{index}.demos={demos}", f"domains.{index}.heldout=12", f"domains.{index}.validation=0"]
    recipe = _recipe(tmp_path, *overrides)
    for spec in recipe.domains:
        spec.level_demos = {level: 3 for level in spec.level_demos}
    run = DemoRun(recipe, tmp_path / "run")
    figures = base(run)
    assert figures["vocab_size"] == 512
    tokenizer = load_tokenizer(Model(path=str(run.base_dir)))
    longest = {}
    for spec in recipe.domains:
        for line in (run.data_dir / f"heldout_{spec.name}.jsonl").read_text().splitlines():
            task = json.loads(line)
            ids = tokenizer.apply_chat_template(task["messages"], add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]
            # Counted in this very tokenizer (the base stage drew them again with it), within the level's length.
            meta = task["metadata"]
            assert meta["tokens_exact"] and meta["context_tokens"] == len(
                tokenizer(task["messages"][-1]["content"], add_special_tokens=False)["input_ids"])
            assert len(ids) + 16 <= meta["length"] <= 8192, (spec.name, task["difficulty"], len(ids))
            longest[spec.name] = max(longest.get(spec.name, 0), len(ids))
    print(json.dumps({"longest_heldout_prompt_tokens": longest}))
    assert longest["needle"] > 7500 and longest["multi_doc_qa"] > 7000  # the 8k levels are long, not nominal


def test_posttrain_demo_runs_a_recipe_file_given_by_recipe(tmp_path):
    from posttrain.cli import main

    path = tmp_path / "mine.yaml"
    path.write_text("stage: demo\noutput_dir: unused\nstages: []\nvocab_size: 320\npreset: tiny-1m\ndomains:\n"
                    "  - {name: needle, args: {lengths: [256]}, demos: 4, heldout: 2, validation: 0}\n")
    assert main(["demo", "--recipe", str(path), "--output", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["stages"]["base"]["heldout_items"] == {"needle": 2}
    assert main(["demo", "--recipe", "no-such-recipe"]) != 0  # a one-line error naming the packaged recipes
