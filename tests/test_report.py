"""The HTML report: self-contained, escaped, re-renderable from results.json, and rendered by a real browser."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from test_eval_pipeline import HOSTILE, run_scripted

from posttrain.evaluate import render_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--window-size=1400,2400"]

# Appended to a copy of the report (the report itself has no script): measures what the browser laid out.
MEASURE = """<script>
const box = e => { const r = e.getBoundingClientRect(); return [Math.round(r.width), Math.round(r.height)]; };
const out = {tables: [...document.querySelectorAll('table')].map(box),
             svgs: [...document.querySelectorAll('svg')].map(box),
             sections: [...document.querySelectorAll('section')].map(s => s.id),
             marks: document.querySelectorAll('svg rect, svg polyline').length};
const pre = document.createElement('pre'); pre.id = 'measured'; pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


@pytest.fixture(scope="module")
def report(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("report")
    _, _, result = run_scripted(root, tiny_tokenizer)
    return result


def test_report_escapes_model_output_and_loads_nothing(report):
    html = report.report_path.read_text()
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html  # the hostile answer, shown as text
    assert "<script" not in html and "<img" not in html and HOSTILE not in html
    assert not re.search(r"<(link|iframe|object|embed)\b", html)
    assert not re.search(r"(src|href)=\"(?!#)", html) and "url(" not in html and "@import" not in html
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) <= {"http://www.w3.org/2000/svg"}


def test_report_renders_from_the_results_json_alone(report):
    results = json.loads(report.results_path.read_text())
    assert render_report(results) == report.report_path.read_text()


def test_report_has_every_section_table_and_chart(report):
    html = report.report_path.read_text()
    for anchor in ("summary", "domains", "fresh", "safety", "curves", "process", "failures", "contamination",
                   "hygiene", "settings"):
        assert f'<section id="{anchor}">' in html
    assert html.count("<table") >= 8 and html.count("<svg") >= 9  # 6 training-curve panels among them
    assert "wrong answer · 4 in rl" in html  # the first two items of each fresh draw and "over-refusal" in html
    assert '<span class="delta up">+33.3</span>' in html  # rl vs sft on the arithmetic held-out set
    assert "No training data was named" in html


@pytest.mark.chromium
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium")
def test_chromium_renders_the_tables_and_plots(report, tmp_path):
    page = tmp_path / "measured.html"
    page.write_text(report.report_path.read_text().replace("</body>", MEASURE + "</body>"))
    profile = tmp_path / "profile"
    dom = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=180, check=False).stdout
    measured = json.loads(re.search(r'<pre id="measured">(.*?)</pre>', dom, re.DOTALL).group(1)
                          .replace("&quot;", '"'))
    assert len(measured["tables"]) >= 8 and all(w > 200 and h > 30 for w, h in measured["tables"])
    assert len(measured["svgs"]) >= 9 and all(w > 100 and h > 20 for w, h in measured["svgs"])
    assert measured["marks"] >= 15  # bars and lines were drawn
    assert {"summary", "domains", "safety", "curves", "failures", "contamination"} <= set(measured["sections"])

    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}-shot", f"--screenshot={shot}",
                    report.report_path.as_uri()], capture_output=True, timeout=180, check=False)
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 2400)
    colors = image.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 200  # text, charts and the header gradient, not a blank page
    assert max(count for count, _ in colors) < 0.8 * image.size[0] * image.size[1]


def summary_section(html: str) -> str:
    return html.split('<section id="summary">', 1)[1].split("</section>", 1)[0]


def test_headline_cards_describe_the_named_checkpoint_not_the_last_evaluated(report):
    results = json.loads(report.results_path.read_text())
    assert results["headline"] == {"checkpoint": "rl", "against": "sft"}  # the default: the last, vs the one before
    sft = results["metrics"]["sft"]["arithmetic"]["overall"]["pass@1"]
    rl = results["metrics"]["rl"]["arithmetic"]["overall"]["pass@1"]
    assert sft != rl

    def held_out_card(html: str) -> str:
        return summary_section(html).split('<div class="k">held-out pass@1</div><div class="v">', 1)[1].split("<")[0]

    # A pipeline that evaluates a control after its product (the demo: sft, rl, then sft_control) names the
    # product: the cards then show it, compared with what it is compared against, whatever was evaluated last.
    results["headline"] = {"checkpoint": "sft", "against": None}
    html = render_report(results)
    assert "Figures of the headline checkpoint, <b>sft</b>." in summary_section(html)
    capability = [s["name"] for s in results["suites"] if s["kind"] == "heldout" and s["name"] != "safety"]
    assert capability == ["arithmetic"]
    assert held_out_card(html) == f"{sft * 100:.1f}%" and held_out_card(report.report_path.read_text()) == \
        f"{rl * 100:.1f}%"
    assert "failed episodes</div><div class=\"v\">" in summary_section(html)
    assert "sft, every suite" in summary_section(html)


def test_a_headline_label_that_names_no_checkpoint_is_a_config_error():
    from pydantic import ValidationError

    from posttrain.config import EvalRecipe

    with pytest.raises(ValidationError, match=r"report.headline: 'rl' is not a checkpoint label"):
        EvalRecipe.model_validate({"checkpoints": ["runs/sft/final"], "report": {"headline": "rl"}})


def test_a_pipeline_s_own_tables_are_shown_as_given_and_escaped(report):
    results = json.loads(report.results_path.read_text())
    assert results["tables"] == [] and 'id="runs"' not in report.report_path.read_text()
    results["tables"] = [{"title": "RL <step> time", "lead": "judging & more",
                          "head": ["domain", "share", "tokens", "note"], "percent": [1],
                          "rows": [["<code>", 0.347, 742798, "sandbox"], ["all", None, 12.5, None]]}]
    html = render_report(results)
    section = html.split('<section id="runs">')[1].split("</section>")[0]
    assert "RL &lt;step&gt; time" in section and "judging &amp; more" in section
    assert "<td>&lt;code&gt;</td><td>34.7%</td><td>742,798</td><td>sandbox</td>" in section
    assert "<td>all</td><td>–</td><td>12.5</td><td>–</td>" in section
    assert section.count("<svg") == 1 and ">share</span>" in section  # the fractions as bars, with their legend
    assert "share · &lt;code&gt;: 34.7%" in section  # a bar is named by the text before the fractions
    assert '<a href="#runs">' in html


def test_a_report_table_whose_row_does_not_fit_its_head_is_a_config_error():
    from pydantic import ValidationError

    from posttrain.config import EvalRecipe

    table = {"title": "compute", "head": ["stage", "tokens"], "rows": [["rl", 5], ["sft", 1, 2]]}
    with pytest.raises(ValidationError, match=r"report.tables 'compute': row 1 has 3 cells, the head 2"):
        EvalRecipe.model_validate({"checkpoints": ["runs/sft/final"], "report": {"tables": [table]}})
    with pytest.raises(ValidationError, match=r"percent columns \[2\] are not columns"):
        EvalRecipe.model_validate({"checkpoints": ["runs/sft/final"],
                                   "report": {"tables": [{**table, "rows": [], "percent": [2]}]}})
