"""The report's length x depth heat map: from a scripted policy with known answers (the figures checked cell by
cell), and from a real tiny checkpoint run through the engine on needle tasks."""

from __future__ import annotations

import json
import re

from test_envs_scripted import ScriptedEngine

from posttrain.config import EvalRecipe
from posttrain.evaluate import Policy, build_suites, evaluate, length_depth_metrics, render_report
from posttrain.evaluate.svg import heat_color

NEEDLE = {"domain": "needle", "args": {"lengths": [128, 256], "depths": [0.0, 0.5, 1.0]}, "levels": [1, 2], "n": 30}


def _recipe(root, checkpoints, suites=(NEEDLE,), **extra) -> EvalRecipe:
    return EvalRecipe.model_validate({"output_dir": str(root / "eval"), "checkpoints": checkpoints,
                                      "suites": {"generated": list(suites)}, "fresh_draw": {"enabled": False},
                                      "sampling": {"max_new_tokens": 12}, **extra})


def test_heat_map_cells_match_a_scripted_policy(tmp_path, tiny_tokenizer):
    # Right at depth 0 (whatever the length) and everywhere at 128 tokens; wrong otherwise.
    recipe = _recipe(tmp_path, [{"path": "scripted", "label": "scripted"}],
                     suites=[NEEDLE, {"domain": "arithmetic", "levels": [1], "n": 4}])
    suites = build_suites(recipe)

    def right(task) -> bool:
        return task.metadata["depth"] == 0.0 or task.metadata["length"] == 128

    answers = {t.id: [t.metadata["answer"] if t.domain != "needle" or right(t) else "000000"]
               for suite in suites for t in suite.tasks}
    result = evaluate(recipe, suites=suites, loader=lambda path, runtime: Policy(
        ScriptedEngine(tiny_tokenizer, answers), tiny_tokenizer, path))
    results = json.loads(result.results_path.read_text())
    grid = results["metrics"]["scripted"]["needle"]["length_depth"]
    assert "length_depth" not in results["metrics"]["scripted"]["arithmetic"]  # only long-context suites have one
    assert grid["lengths"] == [128, 256] and len(grid["depths"]) == 5
    tasks = suites[0].tasks
    for row, length in enumerate(grid["lengths"]):
        for column, cell in enumerate(grid["cells"][row]):
            mine = [t for t in tasks
                    if t.metadata["length"] == length and min(4, int(t.metadata["depth"] * 5)) == column]
            if not mine:
                assert cell is None
                continue
            assert cell["items"] == len(mine) and cell["passed"] == sum(right(t) for t in mine)
            assert cell["pass@1"] == (1.0 if length == 128 or column == 0 else 0.0)
    assert [cell is None for cell in grid["cells"][0]] == [False, True, False, True, False]  # depths 0, .5, 1

    html = result.report_path.read_text()
    assert '<section id="long-context">' in html and '<a href="#long-context">' in html
    section = html.split('<section id="long-context">')[1].split("</section>")[0]
    assert section.count("<svg") == 1
    shaded = re.findall(r'<rect [^>]*fill="(#[0-9A-F]{6})"><title>([^<]*)</title>', section)
    assert len(shaded) == 6  # 2 lengths x 3 depths with items
    assert {fill for fill, _ in shaded} == {heat_color(1.0), heat_color(0.0)}
    assert any(tip.startswith("256 · 40-60%: 0.0% of ") for _, tip in shaded)
    assert render_report(results) == html


def test_a_report_without_long_context_suites_has_no_heat_map(tmp_path, tiny_tokenizer):
    recipe = _recipe(tmp_path, [{"path": "scripted", "label": "s"}], suites=[{"domain": "arithmetic", "n": 3}])
    suites = build_suites(recipe)
    answers = {t.id: [t.metadata["answer"]] for t in suites[0].tasks}
    result = evaluate(recipe, suites=suites, loader=lambda path, runtime: Policy(
        ScriptedEngine(tiny_tokenizer, answers), tiny_tokenizer, path))
    html = result.report_path.read_text()
    assert "long-context" not in html
    assert length_depth_metrics([]) is None


def test_heat_map_from_a_tiny_checkpoint_through_the_engine(tmp_path, policy_dir):
    suite = {**NEEDLE, "n": 10}
    recipe = _recipe(tmp_path, [str(policy_dir)], suites=[suite], runtime={"batch_size": 10, "precision": "fp32"})
    result = evaluate(recipe)
    results = json.loads(result.results_path.read_text())
    (label,) = results["metrics"]
    grid = results["metrics"][label]["needle"]["length_depth"]
    cells = [cell for row in grid["cells"] for cell in row if cell is not None]
    assert sum(cell["items"] for cell in cells) == 10 and grid["lengths"] == [128, 256]
    overall = results["metrics"][label]["needle"]["overall"]["pass@1"]
    assert sum(cell["passed"] for cell in cells) == round(overall * 10)  # an untrained model: ~0, but counted
    assert '<section id="long-context">' in result.report_path.read_text()
