"""The packaged `vlm-demo` recipe loads strictly and runs end to end on a tiny budget: SFT, the image self-test,
GRPO, three held-out scores, results.json and a report with the image section."""

import json

import pytest

from posttrain.config import ConfigError, VLMDemoRecipe, load_recipe
from posttrain.demo.vlm import run_vlm_demo
from posttrain.cli.stages import recipe_path

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_vlm_demo_runs_sft_then_grpo_and_writes_its_figures_and_report(tmp_path):
    recipe = load_recipe(recipe_path("vlm-demo"), [f"output_dir={tmp_path}", "demos=4", "heldout=2", "sft.steps=2",
                                                   "rl.steps=1", "rl.tasks_per_step=2", "rl.group_size=2"],
                         schema=VLMDemoRecipe)
    figures = run_vlm_demo(recipe)
    assert set(figures["heldout"]) == {"base", "sft", "rl"}
    assert figures["rl"]["self_test_gap_max"] < 1e-4
    (gain,) = figures["rl_gain_by_domain"].values()  # the recipe's one domain, its items paired before and after
    assert gain["items"] == 2 and gain["better"] - gain["worse"] == round(gain["gain"] * 2)
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["images"]) == {"base", "sft", "rl"}
    assert '<section id="images">' in (tmp_path / "report.html").read_text()
    assert (tmp_path / "model" / "config.json").is_file()
    with pytest.raises(ConfigError, match="sft"):
        load_recipe(recipe_path("vlm-demo"), ["sft.stepz=3"], schema=VLMDemoRecipe)
    with pytest.raises(ConfigError, match="rl.domains"):
        load_recipe(recipe_path("vlm-demo"), ["rl.domains=[bar_value]"], schema=VLMDemoRecipe)


def test_the_paired_gain_counts_each_held_out_item_once_with_its_standard_error():
    from posttrain.demo.vlm import paired_gain
    from posttrain.evaluate import ImageCase
    from posttrain.evaluate.images import suite_score

    def suite(outcomes):
        return suite_score("held-out", [ImageCase(f"t{i}", "largest_colour", 1, "q", "red", "", ok, "")
                                        for i, ok in enumerate(outcomes)])

    gain = paired_gain(suite([0, 0, 1, 1]), suite([1, 0, 1, 1]))["largest_colour"]  # one item better, none worse
    assert gain["gain"] == 0.25 and (gain["better"], gain["worse"], gain["items"]) == (1, 0, 4)
    assert gain["standard_error"] == pytest.approx((0.25 / 4) ** 0.5)  # var([1,0,0,0]) = 0.25, over n = 4


def test_posttrain_demo_with_the_vlm_recipe_runs_the_vlm_demo(tmp_path, capsys):
    from posttrain.cli import main

    out = tmp_path / "run"
    code = main(["demo", "--recipe", "vlm-demo", "--output", str(out), "demos=4", "heldout=2", "sft.steps=2",
                 "rl.steps=1", "rl.tasks_per_step=2", "rl.group_size=2"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["title"] == "vlm-demo" and results["figures"]["sft"]["steps"] == 2
    assert "[vlm-demo] held-out pass@1" in capsys.readouterr().out
    assert main(["demo", "--recipe", "vlm-demo", "--resume"]) == 2  # a user error, one line
    assert "no resume" in capsys.readouterr().err
    assert main(["demo", "--recipe", "vlm-demo", "sft.stepz=3"]) == 2
    assert "stepz" in capsys.readouterr().err
