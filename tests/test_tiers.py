"""The tier table: `measure_tier`'s figures, the baseline arithmetic, the schema's checks, an eval of a real tiny
checkpoint and its int8 quantization as two tiers, and the report's tier section with its two plots."""

from __future__ import annotations

import time

import pytest

from posttrain.config import EvalRecipe, EvalTiers
from posttrain.evaluate import EvalError, evaluate, measure_tier, render_report, tier_table
from posttrain.types import Completion

pytestmark = pytest.mark.usefixtures("one_thread")


class PacedEngine:
    """An `InferenceEngine` that takes `seconds_per_token` per generated token and returns `tokens` tokens."""

    runner = "paced"

    def __init__(self, seconds_per_token: float, tokens: int):
        self.seconds_per_token, self.tokens, self.calls = seconds_per_token, tokens, 0

    def generate(self, requests, sampling):
        self.calls += 1
        assert sampling.temperature == 0 and len(requests) == 1  # greedy, one request at a time
        count = min(self.tokens, sampling.max_new_tokens)
        time.sleep(self.seconds_per_token * count)
        return [[Completion(list(range(count)), "", [0.0] * count, "length", 0)]]


def test_measure_tier_counts_tokens_and_times_each_request():
    engine = PacedEngine(0.004, tokens=5)
    speed = measure_tier(engine, [[1, 2], [3]], max_new_tokens=8, repeats=2, warmup=1)
    assert engine.calls == 2 * (1 + 2) and speed.requests == 4 and speed.tokens == 4 * 5
    assert speed.p50_latency_ms >= 5 * 4 and speed.p90_latency_ms >= speed.p50_latency_ms
    assert 5 < speed.tokens_per_s <= 250  # a sleep never ends early: at most 1 / 0.004 tokens per second
    assert speed.ms_per_token >= 4 and speed.runner == "paced" and speed.acceptance_rate is None
    with pytest.raises(ValueError, match="no prompts"):
        measure_tier(engine, [])


def test_tier_table_compares_against_the_first_standard_tier():
    rows = [{"label": "q", "kind": "quantized", "accuracy": 0.5, "tokens_per_s": 30.0},
            {"label": "std", "kind": "standard", "accuracy": 0.75, "tokens_per_s": 20.0},
            {"label": "student", "kind": "distilled", "accuracy": None, "tokens_per_s": 50.0}]
    table = tier_table(rows, EvalTiers(), ["arithmetic"])
    assert table["baseline"] == "std" and table["accuracy_suites"] == ["arithmetic"]
    assert [r["speedup"] for r in rows] == [1.5, 1.0, 2.5]
    assert rows[0]["accuracy_delta"] == pytest.approx(-0.25) and rows[2]["accuracy_delta"] is None


def test_tier_schema_checks_labels_suites_and_emptiness():
    suites = {"generated": [{"domain": "arithmetic", "n": 4}]}
    tier = {"label": "a", "path": "x"}
    with pytest.raises(ValueError, match="labels must differ"):
        EvalRecipe.model_validate({"checkpoints": [{"path": "y", "label": "a"}], "tiers": {"models": [tier]}})
    with pytest.raises(ValueError, match="tiers.suite: no suite named 'math'"):
        EvalRecipe.model_validate({"suites": suites, "tiers": {"models": [tier], "suite": "math"}})
    with pytest.raises(ValueError, match="at least one checkpoint"):
        EvalRecipe.model_validate({"suites": suites})
    with pytest.raises(ValueError, match="kind"):
        EvalRecipe.model_validate({"tiers": {"models": [{**tier, "kind": "turbo"}]}})
    recipe = EvalRecipe.model_validate({"suites": suites, "tiers": {"models": [tier]}})
    assert recipe.checkpoints == [] and recipe.tiers.models[0].engine.runner == "auto"


def test_a_checkpoint_and_its_int8_quantization_as_tiers(tmp_path, tiny_tokenizer, tiny_model, capsys):
    pytest.importorskip("torchao")
    from posttrain.models import quantize_checkpoint, save_model_dir

    standard = save_model_dir(tmp_path / "std", tiny_model, tiny_tokenizer)
    quantized = quantize_checkpoint(standard, tmp_path / "std-int8", to="int8")
    recipe = EvalRecipe.model_validate({
        "output_dir": str(tmp_path / "eval"), "fresh_draw": {"enabled": False},
        "suites": {"generated": [{"domain": "arithmetic", "levels": [1], "n": 4}]},
        "sampling": {"max_new_tokens": 6}, "runtime": {"batch_size": 4, "precision": "fp32", "num_threads": 1},
        "tiers": {"prompts": 2, "max_new_tokens": 6, "repeats": 1, "warmup": 0, "models": [
            {"label": "standard", "path": str(standard)},
            {"label": "int8", "path": str(quantized), "kind": "quantized"}]},
    })
    result = evaluate(recipe)
    table = result.results["tiers"]
    standard_row, int8_row = table["rows"]
    assert table["baseline"] == "standard" and table["accuracy_suites"] == ["arithmetic"]
    assert standard_row["runner"] == "fast" and int8_row["runner"] == "generic"
    assert int8_row["quantization"]["target"] == "int8" and standard_row["quantization"] is None
    assert standard_row["speedup"] == 1.0 and int8_row["speedup"] > 0 and int8_row["requests"] == 2
    assert int8_row["accuracy"] == result.figure("int8", "arithmetic")
    assert [c.get("tier") for c in result.results["checkpoints"]] == ["standard", "quantized"]
    html = result.report_path.read_text()
    assert '<section id="tiers">' in html and 'href="#tiers"' in html
    assert "accuracy against tokens/s" in html and "accuracy against p50 latency" in html
    from posttrain.evaluate import print_results

    print_results(result.results)
    printed = capsys.readouterr().err  # the console is stderr
    assert "tiers (against standard)" in printed and "1.00x" in printed and "generic" in printed


def test_an_engine_option_the_engine_does_not_take_is_named(tmp_path, tiny_tokenizer, tiny_model):
    from posttrain.config import TierEngine
    from posttrain.evaluate import load_policy
    from posttrain.models import save_model_dir

    path = save_model_dir(tmp_path / "m", tiny_model, tiny_tokenizer)
    with pytest.raises(EvalError, match="engine.options.*warp_speed"):
        load_policy(path, engine=TierEngine(options={"warp_speed": 9}))
    with pytest.raises(EvalError, match=r"\['runner'\] are set by"):
        load_policy(path, engine=TierEngine(options={"runner": "fast"}))


def test_report_tier_section_renders_from_results_alone_and_escapes():
    hostile = "<b>x</b>"
    rows = [{"label": "standard", "kind": "standard", "accuracy": 0.8, "tokens_per_s": 100.0, "p50_latency_ms": 320,
             "p90_latency_ms": 400, "ms_per_token": 10.0, "runner": "fast", "engine": {"runner": "auto",
                                                                                        "options": {}}},
            {"label": hostile, "kind": "speculative", "accuracy": 0.8, "tokens_per_s": 180.0, "p50_latency_ms": 180,
             "p90_latency_ms": 200, "ms_per_token": 5.5, "runner": "fast", "acceptance_rate": 0.62,
             "engine": {"runner": "auto", "options": {"speculative": {"draft": "tiny-1m"}}}}]
    results = {"checkpoints": [{"label": "standard", "path": "a"}, {"label": hostile, "path": "b"}],
               "tiers": tier_table(rows, EvalTiers(), ["arithmetic"])}
    html = render_report(results)
    section = html[html.index('<section id="tiers">'):]
    section = section[:section.index("</section>")]
    assert "1.80×" in section and "62.0%" in section and "&lt;b&gt;x&lt;/b&gt;" in section and hostile not in section
    assert section.count("<svg") == 2 and section.count("<circle") == 4
    assert "speculative" in section and "&quot;draft&quot;" in section


def test_the_packaged_tiers_recipe_validates():
    from posttrain.cli import packaged_recipe
    from posttrain.config import load_recipe

    recipe = load_recipe(packaged_recipe("eval-tiers"))
    assert isinstance(recipe, EvalRecipe) and [t.kind for t in recipe.tiers.models] == [
        "standard", "quantized", "quantized"]


@pytest.mark.chromium
def test_chromium_lays_out_the_tier_table_and_plots(tmp_path):
    import json
    import re
    import subprocess

    from test_report import CHROMIUM, CHROMIUM_FLAGS

    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium")
    rows = [{"label": name, "kind": kind, "accuracy": accuracy, "tokens_per_s": speed, "p50_latency_ms": 1000 / speed,
             "p90_latency_ms": 1100 / speed, "ms_per_token": 30 / speed, "runner": "fast",
             "engine": {"runner": "auto", "options": {}}}
            for name, kind, accuracy, speed in [("standard", "standard", 0.9, 50.0), ("int8", "quantized", 0.88, 20.0)]]
    results = {"checkpoints": [{"label": r["label"], "path": "x"} for r in rows],
               "tiers": tier_table(rows, EvalTiers(), ["arithmetic"])}
    measure = """<script>
    const box = e => { const r = e.getBoundingClientRect(); return [Math.round(r.width), Math.round(r.height)]; };
    const section = document.getElementById('tiers');
    const out = {table: box(section.querySelector('table')), svgs: [...section.querySelectorAll('svg')].map(box),
                 dots: [...section.querySelectorAll('svg circle')].map(box)};
    const pre = document.createElement('pre'); pre.id = 'measured'; pre.textContent = JSON.stringify(out);
    document.body.appendChild(pre);
    </script>"""
    page = tmp_path / "tiers.html"
    page.write_text(render_report(results).replace("</body>", measure + "</body>"))
    dom = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
                          page.as_uri()], capture_output=True, text=True, timeout=180, check=False).stdout
    measured = json.loads(re.search(r'<pre id="measured">(.*?)</pre>', dom, re.DOTALL).group(1)
                          .replace("&quot;", '"'))
    assert measured["table"][0] > 300 and measured["table"][1] > 60
    assert len(measured["svgs"]) == 2 and all(w > 300 and h > 150 for w, h in measured["svgs"])
    assert len(measured["dots"]) == 4 and all(w >= 8 for w, _ in measured["dots"])  # drawn, not collapsed
