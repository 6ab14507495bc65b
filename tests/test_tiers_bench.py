"""bench/tiers.py end to end in miniature (70-100 s: slow): a tiny-3m standard model trained 90 SFT steps, a
tiny-1m student distilled from it, its int8 copy, and the eval's tier table with all four kinds (speculative
twice: the student as draft, and prompt lookup). Speculation must not change greedy outputs, so the speculative
tiers' accuracy and failure examples equal the standard model's exactly; int8 stays within a few points of it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def _bench():
    spec = importlib.util.spec_from_file_location("tiers_bench", ROOT / "bench" / "tiers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _answers(summary, label):
    """The assistant texts of a tier's failure examples, by task."""
    examples = summary["examples"][label]["arithmetic"]
    return {e["task_id"]: e["messages"][-1]["content"] for group in examples.values() for e in group}


def test_the_four_tier_table_end_to_end(tmp_path):
    pytest.importorskip("torchao")
    summary = _bench().run(tmp_path, teacher_steps=90, student_steps=6, heldout=24, prompts=3, max_new_tokens=12,
                           repeats=2, out=tmp_path / "report")
    table = summary["table"]
    rows = {row["label"]: row for row in table["rows"]}
    assert list(rows) == ["standard", "student", "spec-student", "spec-ngram", "int8"]
    assert {row["kind"] for row in rows.values()} == {"standard", "distilled", "speculative", "quantized"}
    assert table["baseline"] == "standard" and rows["standard"]["speedup"] == 1.0
    standard = rows["standard"]["accuracy"]
    # 90 steps leave the standard model right on some items and wrong on others (0.25 here): both kinds compare
    assert standard is not None and 0.0 < standard < 1.0 and _answers(summary, "standard")
    for label in ("spec-student", "spec-ngram"):  # greedy speculation decodes exactly what plain decoding does
        assert rows[label]["accuracy"] == standard
        assert rows[label]["accuracy_delta"] == 0.0
        assert 0.0 <= rows[label]["acceptance_rate"] <= 1.0
        assert _answers(summary, label) == _answers(summary, "standard")  # the same failures, word for word
    assert abs(rows["int8"]["accuracy"] - standard) <= 2 / 24 + 1e-9  # within a few points: two items of 24
    assert rows["int8"]["runner"] == "generic" and rows["int8"]["quantization"]["target"] == "int8"
    assert rows["student"]["path"] == rows["spec-student"]["engine"]["speculative"]["draft"]
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["p90_latency_ms"] >= row["p50_latency_ms"] > 0
        assert row["requests"] == 2 * 3 and row["tokens"] > 0 and row["speedup"] > 0
        assert 0.0 <= row["accuracy"] <= 1.0
    line = {k: v for k, v in summary.items() if k != "table"}
    json.dumps(line)  # the bench's one JSON line
    assert summary["fastest"] in rows and summary["ratio"] == pytest.approx(
        rows[summary["fastest"]]["tokens_per_s"] / rows["standard"]["tokens_per_s"], rel=1e-2)
    assert isinstance(summary["load_avg_1m"], float)
    written = json.loads((tmp_path / "report" / "results.json").read_text())
    assert [r["label"] for r in written["tiers"]["rows"]] == list(rows)
    html = (tmp_path / "report" / "report.html").read_text()
    assert '<section id="tiers">' in html and "spec-student" in html
