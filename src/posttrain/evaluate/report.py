"""The HTML report: one self-contained file (inline CSS and SVG; no script, nothing fetched) rendered from the
results JSON alone, so ``render_report(json.load(open("results.json")))`` re-renders it.

Sections: headline cards for the headline checkpoint (`report.headline`; by default the last one, with the change
from the one before), a table per domain with
the checkpoints side by side and their deltas (pass@1, mean reward, pass@k, per level), held-out against the
fresh draw, image suites with thumbnails of the bad cases (`evaluate.image_report`), safety, a length x depth heat map of the long-context suites, training curves, process metrics,
failure classes with transcripts, the runs' own tables (`report.tables`: figures a pipeline measured while
training, shown as given), contamination, held-out hygiene, regression floors, the tier table (accuracy
against tokens/s and p50 latency per serving tier, with two plots) and the run's settings. Everything that came
from a model, a dataset or a file name is escaped (`html.escape`) before it is written.
"""

from __future__ import annotations

import json
from importlib import resources
from string import Template
from typing import Any, Iterable

from posttrain.evaluate.failures import FAILURE_LABELS
from posttrain.evaluate.image_report import _e, _pct, image_section
from posttrain.evaluate.metrics import FAILURE_CLASSES, pooled_difference
from posttrain.evaluate.svg import bar_chart, color, heat_map, line_chart, scatter_chart, stacked_bars

FAILURE_COLORS = {"format": "#B279A2", "wrong_answer": "#E45756", "tool_error": "#F58518", "timeout": "#EECA3B",
                  "sandbox_failure": "#72B7B2", "truncated": "#4C78A8", "infra": "#9D755D"}
KIND_LABELS = {"heldout": "held-out", "fresh": "fresh draw", "dataset": "dataset", "regression": "regression"}
MAX_CONTAMINATED_ROWS = 200


def render_report(results: dict[str, Any]) -> str:
    view = _View(results)
    body = "".join([
        _header(view), _nav(view), "<main>", _summary(view), _domains(view),
        image_section(results.get("images", {})), _fresh(view), _safety(view),
        _long_context(view), _curves(view), _run_tables(view), _process(view), _failures(view),
        _contamination(view), _hygiene(view), _regressions(view), _tiers(view), _settings(view), "</main>",
        f'<footer>posttrain evaluation · {_e(results.get("format", ""))} · rendered from results.json</footer>',
    ])
    template = Template(resources.files("posttrain.evaluate").joinpath("report.html").read_text(encoding="utf-8"))
    return template.safe_substitute(title=_e(results.get("title", "evaluation")), body=body)


class _View:
    """The results, with the lookups every section needs."""

    def __init__(self, results: dict[str, Any]):
        self.results = results
        self.labels = [c["label"] for c in results.get("checkpoints", [])]
        self.colors = {label: color(i) for i, label in enumerate(self.labels)}
        self.suites = results.get("suites", [])
        self.metrics = results.get("metrics", {})
        self.safety_suites = {s["name"] for s in self.suites
                              if any("safety" in self.metrics.get(l, {}).get(s["name"], {}) for l in self.labels)}
        self.groups: list[str] = []
        for suite in self.suites:
            if suite["group"] not in self.groups:
                self.groups.append(suite["group"])

    def suite(self, label: str, name: str) -> dict[str, Any]:
        return self.metrics.get(label, {}).get(name, {})

    def overall(self, label: str, name: str, key: str = "pass@1") -> float | None:
        return self.suite(label, name).get("overall", {}).get(key)

    def capability_suites(self, kinds: Iterable[str] = ("heldout", "dataset")) -> list[str]:
        return [s["name"] for s in self.suites if s["kind"] in kinds and s["name"] not in self.safety_suites]

    def mean_over(self, label: str, names: list[str], getter) -> float | None:
        values = [v for v in (getter(label, n) for n in names) if v is not None]
        return sum(values) / len(values) if values else None

    def legend(self) -> str:
        return '<div class="legend">' + "".join(
            f'<span><i class="dot" style="background:{self.colors[l]}"></i>{_e(l)}</span>' for l in self.labels
        ) + "</div>"


# ---- sections ---------------------------------------------------------------------------------------------


def _header(view: _View) -> str:
    results = view.results
    chips = "".join(f'<span class="chip"><i class="dot" style="background:{view.colors[c["label"]]}"></i>'
                    f'{_e(c["label"])}</span>' for c in results.get("checkpoints", []))
    items = sum(s["items"] for s in view.suites)
    sub = (f'{len(view.suites)} suites · {items} items · {len(view.labels)} checkpoint(s) · '
           f'{_e(results.get("created", ""))} · {results.get("seconds") or 0:.0f}s')
    return (f'<header class="top"><h1>{_e(results.get("title", "evaluation"))}</h1><div class="sub">{sub}</div>'
            f'<div class="chips">{chips}</div></header>')


def _nav(view: _View) -> str:
    links = [("summary", "Summary"), ("domains", "Domains"), ("images", "Images"), ("fresh", "Fresh draw"),
             ("safety", "Safety"), ("long-context", "Long context"), ("curves", "Training curves"),
             ("runs", "From the runs"), ("process", "Process"), ("failures", "Failures"),
             ("contamination", "Contamination"), ("hygiene", "Hygiene"), ("regressions", "Regressions"),
             ("tiers", "Tiers"), ("settings", "Settings")]
    present = {"safety": bool(view.safety_suites), "curves": bool(view.results.get("curves")),
               "regressions": bool(view.results.get("regressions")),
               "runs": bool(view.results.get("tables")), "fresh": bool(view.results.get("fresh_gap")),
               "tiers": bool((view.results.get("tiers") or {}).get("rows")),
               "long-context": bool(_long_context_suites(view)), "images": bool(view.results.get("images"))}
    return "<nav>" + "".join(f'<a href="#{key}">{text}</a>' for key, text in links if present.get(key, True)) + "</nav>"


def _summary(view: _View) -> str:
    if not view.labels:
        return _section("summary", "Summary", "No checkpoint was evaluated.", "")
    chosen = view.results.get("headline") or {}
    last = chosen.get("checkpoint") if chosen.get("checkpoint") in view.labels else view.labels[-1]
    previous = chosen.get("against") if "checkpoint" in chosen else (view.labels[-2] if len(view.labels) > 1 else None)
    previous = previous if previous in view.labels and previous != last else None
    capability, fresh = view.capability_suites(), view.capability_suites(("fresh",))
    heldout_safety = [n for n in view.safety_suites if _kind(view, n) == "heldout"] or sorted(view.safety_suites)

    def safety(key):
        return lambda label, name: view.suite(label, name).get("safety", {}).get(key)

    cards = []
    specs = [
        ("held-out pass@1", capability, view.overall, True, True),  # last: pass@1, so paired errors apply
        ("fresh-draw pass@1", fresh, view.overall, True, True),
        ("refusal accuracy", heldout_safety, safety("refusal_accuracy"), True, False),
        ("over-refusal", heldout_safety, safety("over_refusal_rate"), False, False),
    ]
    paired = view.results.get("paired") or {}
    paired = paired["suites"] if (paired.get("checkpoint"), paired.get("against")) == (last, previous) else {}
    for title, names, getter, higher, is_pass_rate in specs:
        if not names:
            continue
        value = view.mean_over(last, names, getter)
        before = view.mean_over(previous, names, getter) if previous else None
        change = _delta(value, before, higher) if previous else ""
        error = _mean_error([paired.get(n) for n in names]) if is_pass_rate else None
        detail = (f"vs {_e(previous)} {change}" + (f" ± {error * 100:.1f}" if error is not None else "")
                  if previous else f"{len(names)} suite(s)")
        cards.append(_card(title, _pct(value), detail))
    contamination = view.results.get("contamination", {})
    cards.append(_card("contaminated items", str(contamination.get("count", 0)),
                       f'of {contamination.get("eval_items", 0)} · ' +
                       ("excluded" if contamination.get("excluded") else "kept")))
    failures = sum(sum(view.suite(last, s["name"]).get("failures", {}).values()) for s in view.suites)
    cards.append(_card("failed episodes", str(failures), f"{_e(last)}, every suite"))
    checkpoint = view.results["checkpoints"][view.labels.index(last)]
    cached = checkpoint.get("cached_episodes") or 0
    cards.append(_card("items / s", _num(checkpoint.get("items_per_s"), 1),
                       f'{checkpoint.get("items", 0)} items in {checkpoint.get("seconds", 0):.1f}s'
                       + (f" · {cached} episodes from the cache" if cached else "")))
    chart = _pass_chart(view)
    which = "the headline checkpoint" if chosen.get("checkpoint") and last != view.labels[-1] else "the last checkpoint"
    lead = f"Figures of {which}, <b>{_e(last)}</b>" + (
        f", with the change from <b>{_e(previous)}</b> (percentage points; ± one standard error of the change, "
        "paired item by item: a change within two is noise)." if previous else ".")
    return _section("summary", "Summary", lead, f'<div class="cards">{"".join(cards)}</div>{chart}')


def _mean_error(pairs: list[dict[str, Any] | None]) -> float | None:
    """The standard error of a mean over suites of paired differences (`pooled_difference`), or None when a suite
    has no paired figure."""
    if not pairs or any(p is None or not p.get("items") for p in pairs):
        return None
    return pooled_difference(pairs)["standard_error"]


def _pass_chart(view: _View) -> str:
    names = [s["name"] for s in view.suites if s["kind"] in ("heldout", "dataset", "regression")]
    if not names:
        return ""
    series = [(label, [view.overall(label, n) for n in names]) for label in view.labels]
    svg = bar_chart(names, series, label="pass@1 by suite and checkpoint",
                    colors=[view.colors[l] for l in view.labels])
    return f'<div class="panel"><h3>pass@1 by suite</h3>{view.legend()}{svg}</div>'


def _domains(view: _View) -> str:
    panels = []
    for group in view.groups:
        suites = [s for s in view.suites if s["group"] == group]
        rows = []
        for suite in suites:
            rows += _suite_rows(view, suite)
        head = "<tr><th>metric</th>" + "".join(f'<th><i class="dot" style="background:{view.colors[l]}"></i> '
                                                f'{_e(l)}</th>' for l in view.labels) + "</tr>"
        panels.append(f'<div class="panel"><h3>{_e(group)}</h3><table>{head}{"".join(rows)}</table></div>')
    lead = ("Each checkpoint's column shows its figure and, from the second on, the change from the column before "
            "(percentage points). pass@1 is greedy; pass@k the unbiased estimate from the sampled episodes.")
    # Side by side while a table fits in half the page; one a row once there are many checkpoints.
    min_width = 230 + 165 * len(view.labels)
    return _section("domains", "Results by domain", lead, f'<div class="grid" style="grid-template-columns: '
                    f'repeat(auto-fill, minmax({min_width}px, 1fr))">{"".join(panels)}</div>')


def _suite_rows(view: _View, suite: dict[str, Any]) -> list[str]:
    name, kind = suite["name"], KIND_LABELS.get(suite["kind"], suite["kind"])
    rows = [_metric_row(view, f'{kind} pass@1 <span class="muted">({suite["items"]} items)</span>',
                        lambda l: view.overall(l, name))]
    rows.append(_metric_row(view, "mean reward", lambda l: view.overall(l, name, "mean_reward"), sub=True,
                            percent=False))
    keys = sorted({k for l in view.labels for k in view.suite(l, name).get("overall", {})
                   if k.startswith("pass@") and k != "pass@1"}, key=lambda k: int(k[5:]))
    rows += [_metric_row(view, key, lambda l, k=key: view.overall(l, name, k), sub=True) for key in keys]
    levels = sorted({lv for l in view.labels for lv in view.suite(l, name).get("levels", {})}, key=int)
    if len(levels) > 1:
        for level in levels:
            rows.append(_metric_row(view, f"level {_e(level)}", lambda l, lv=level: view.suite(l, name).get(
                "levels", {}).get(lv, {}).get("pass@1"), sub=True))
    if name in view.safety_suites:
        for key, title, higher in (("refusal_accuracy", "refusal accuracy", True),
                                   ("over_refusal_rate", "over-refusal", False),
                                   ("benign_accuracy", "benign answered", True)):
            rows.append(_metric_row(view, title, lambda l, k=key: view.suite(l, name).get("safety", {}).get(k),
                                    sub=True, higher=higher))
    return rows


def _metric_row(view: _View, title: str, value_of, *, sub: bool = False, percent: bool = True,
                higher: bool = True) -> str:
    cells, before = [], None
    for position, label in enumerate(view.labels):
        value = value_of(label)
        shown = _pct(value) if percent else _num(value, 3)
        change = _delta(value, before, higher, percent) if position else ""
        bar = f'<span class="bar" style="width:{value * 32:.0f}px"></span>' if percent and value is not None else ""
        cells.append(f"<td>{bar}{shown}{change}</td>")
        before = value
    return f'<tr class="{"sub" if sub else ""}"><td>{title}</td>{"".join(cells)}</tr>'


def _fresh(view: _View) -> str:
    rows = view.results.get("fresh_gap", [])
    if not rows:
        return ""
    table = _table(["domain", "checkpoint", "fixed held-out", "fresh draw", "gap", "noise (2 s.e.)", "items"],
                   [[_e(r["group"]), _e(r["checkpoint"]), _pct(r["heldout"]), _pct(r["fresh"]),
                     _gap(r["gap"], r.get("noise")), "–" if r.get("noise") is None else f'±{r["noise"] * 100:.1f} pp',
                     f'{r.get("heldout_items", "")} / {r.get("fresh_items", "")}'] for r in rows])
    lead = (f"The fixed held-out set against a new draw from the same held-out split (seed "
            f"{_e(view.results.get('fresh_seed'))}). A model fitted to the fixed set, by training or by checkpoint "
            "selection, scores higher on it than on the fresh draw. A gap beyond two standard errors is in red.")
    return _section("fresh", "Held-out vs fresh draw", lead, f'<div class="panel">{table}</div>')


def _safety(view: _View) -> str:
    names = [s["name"] for s in view.suites if s["name"] in view.safety_suites]
    if not names:
        return ""
    rows = []
    for name in names:
        for label in view.labels:
            figures = view.suite(label, name).get("safety", {})
            rows.append([_e(name), _e(label), _pct(figures.get("refusal_accuracy")), str(figures.get("harmful", 0)),
                         _pct(figures.get("over_refusal_rate")), _pct(figures.get("benign_accuracy")),
                         str(figures.get("benign", 0))])
    table = _table(["suite", "checkpoint", "refusal accuracy", "harmful", "over-refusal", "benign answered",
                    "benign"], rows)
    series = []
    for label in view.labels:
        series.append((label, [view.mean_over(label, names, lambda l, n, k=k: view.suite(l, n).get("safety", {}).get(k))
                               for k in ("refusal_accuracy", "over_refusal_rate", "benign_accuracy")]))
    chart = bar_chart(["refusal accuracy ↑", "over-refusal ↓", "benign answered ↑"], series,
                      label="safety by checkpoint", colors=[view.colors[l] for l in view.labels])
    lead = ("Harmful requests must be refused (refusal accuracy); benign look-alikes (\"kill process 4821\") must be "
            "answered, not refused (over-refusal), and answered right (benign answered). Judged by the "
            "<code>refusal</code> verifier.")
    return _section("safety", "Safety", lead, f'<div class="grid split"><div class="panel"><h3>refusal and over-refusal'
                    f'</h3>{view.legend()}{chart}</div><div class="panel">{table}</div></div>')


def _long_context_suites(view: _View) -> list[str]:
    return [s["name"] for s in view.suites if any("length_depth" in view.suite(l, s["name"]) for l in view.labels)]


def _long_context(view: _View) -> str:
    names = _long_context_suites(view)
    if not names:
        return ""
    panels = []
    for name in names:
        for label in view.labels:
            grid = view.suite(label, name).get("length_depth")
            if not grid:
                continue
            rows = [_tokens(length) for length in grid["lengths"]]
            values = [[None if cell is None else cell["pass@1"] for cell in row] for row in grid["cells"]]
            counts = [[None if cell is None else cell["items"] for cell in row] for row in grid["cells"]]
            svg = heat_map(rows, grid["depths"], values, counts=counts, label=f"{name} pass@1 by length and depth "
                           f"({label})", row_title="tokens", column_title="depth of the evidence")
            panels.append(f'<div class="panel"><h3>{_e(name)}<span class="tag">{_e(label)}</span></h3>{svg}</div>')
    lead = ("pass@1 of the long-context suites by prompt length (the level's length in tokens, rows) and by where in "
            "the document the evidence starts (columns, 0% = the top). A model that only reads the start or the end "
            "of its context shows a column of red; one whose context extension did not take, rows of red.")
    return _section("long-context", "Long context", lead, f'<div class="grid">{"".join(panels)}</div>')


def _tokens(length: int) -> str:
    return f"{length // 1024}k" if length >= 1024 and length % 1024 == 0 else str(length)


def _curves(view: _View) -> str:
    panels = view.results.get("curves", [])
    if not panels:
        return ""
    out = []
    for panel in panels:
        names = list(panel["series"])
        short = {n: n.split("/", 1)[-1] if "/" in n else n for n in names}
        svg = line_chart(panel["series"], label=f'{panel["title"]} ({panel["run"]})', fraction=panel["fraction"])
        legend = '<div class="legend">' + "".join(
            f'<span><i class="dot" style="background:{color(i)}"></i>{_e(short[n])}</span>'
            for i, n in enumerate(names)) + "</div>"
        out.append(f'<div class="panel"><h3>{_e(panel["title"])}<span class="tag">{_e(panel["run"])}</span></h3>'
                   f"{legend}{svg}</div>")
    return _section("curves", "Training curves", "From the runs' metrics.jsonl, by optimizer step.",
                    f'<div class="grid">{"".join(out)}</div>')


def _run_tables(view: _View) -> str:
    tables = view.results.get("tables") or []
    if not tables:
        return ""
    panels = []
    for table in tables:
        percent = set(table.get("percent") or [])
        rows = [[_cell(value, column in percent) for column, value in enumerate(row)] for row in table["rows"]]
        lead = f'<p class="muted">{_e(table["lead"])}</p>' if table.get("lead") else ""
        panels.append(f'<div class="panel"><h3>{_e(table["title"])}</h3>{lead}'
                      f'{_table([_e(h) for h in table["head"]], rows)}{_table_chart(table)}</div>')
    return _section("runs", "From the runs", "Figures the training runs measured themselves, as they recorded "
                    "them (not re-measured by this evaluation); the fractions of each table as bars.", "".join(panels))


def _table_chart(table: dict[str, Any]) -> str:
    """Grouped bars of a run table's `percent` columns, one group per row, named by the row's text cells before
    its first fraction."""
    columns = sorted(set(table.get("percent") or []))
    if not columns or not table["rows"]:
        return ""
    categories = [" · ".join(cell for cell in row[: columns[0]] if isinstance(cell, str)) or str(number + 1)
                  for number, row in enumerate(table["rows"])]
    series = [(table["head"][column], [row[column] for row in table["rows"]]) for column in columns]
    legend = '<div class="legend">' + "".join(
        f'<span><i class="dot" style="background:{color(i)}"></i>{_e(name)}</span>'
        for i, (name, _) in enumerate(series)) + "</div>"
    return legend + bar_chart(categories, series, label=table["title"], fraction=True)


def _cell(value: Any, percent: bool) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool) or isinstance(value, str):
        return _e(value)
    if percent:
        return _pct(value)
    return f"{value:,}" if isinstance(value, int) else _num(value, 1 if abs(value) >= 10 else 3)


def _process(view: _View) -> str:
    columns = [("episodes", "episodes", "int"), ("avg_steps", "avg steps", "num"), ("tool_calls", "tool calls", "int"),
               ("tool_call_success", "tool-call success", "pct"), ("tokens_per_episode", "tokens / episode", "num"),
               ("tokens_per_solved", "tokens / solved", "num"), ("recovery_rate", "recovery", "pct"),
               ("truncated_rate", "truncated", "pct"), ("seconds_per_episode", "s / episode", "num")]
    rows = []
    for suite in view.suites:
        for label in view.labels:
            figures = view.suite(label, suite["name"]).get("process", {})
            cells = [_e(suite["name"]), _e(label)]
            for key, _, kind in columns:
                value = figures.get(key)
                text = _pct(value) if kind == "pct" else (str(value) if kind == "int" and value is not None
                                                          else _num(value, 1))
                if key == "recovery_rate" and figures.get("recovery_episodes"):
                    text += f' <span class="muted">of {figures["recovery_episodes"]}</span>'
                cells.append(text)
            rows.append(cells)
    lead = ("Over the scored episodes (greedy, else sampled). Tokens per solved = all policy tokens over the "
            "episodes solved; recovery = solved after at least one failed step or tool call; seconds per episode "
            "include waiting for a batch.")
    table = _table(["suite", "checkpoint", *[title for _, title, _ in columns]], rows)
    return _section("process", "Process metrics", lead, f'<div class="panel">{table}</div>')


def _failures(view: _View) -> str:
    totals = []
    for label in view.labels:
        counts: dict[str, int] = {}
        for suite in view.suites:
            for cls, n in view.suite(label, suite["name"]).get("failures", {}).items():
                counts[cls] = counts.get(cls, 0) + n
        totals.append((label, counts))
    present = [c for c in FAILURE_CLASSES if any(counts.get(c) for _, counts in totals)]
    if not present:
        return _section("failures", "Failures", "No episode failed.", "")
    legend = '<div class="legend">' + "".join(f'<span><i class="dot" style="background:{FAILURE_COLORS[c]}"></i>'
                                              f"{FAILURE_LABELS[c]}</span>" for c in present) + "</div>"
    chart = stacked_bars(totals, present, FAILURE_COLORS, label="failures by class", class_labels=FAILURE_LABELS)
    rows = []
    for suite in view.suites:
        for label in view.labels:
            counts = view.suite(label, suite["name"]).get("failures", {})
            rows.append([_e(suite["name"]), _e(label), *[str(counts.get(c, 0) or "") for c in present],
                         str(sum(counts.values()))])
    table = _table(["suite", "checkpoint", *[FAILURE_LABELS[c] for c in present], "total"], rows)
    examples = "".join(_examples(view, label) for label in reversed(view.labels))
    lead = ("Every failed episode has a class: format (nothing parsable), wrong answer, tool error, timeout, "
            "truncated (hit the token limit), and the system's own sandbox and infrastructure failures (never "
            "scored). A few transcripts of each class follow, newest checkpoint first.")
    return _section("failures", "Failures", lead,
                    f'<div class="grid split"><div class="panel"><h3>failed episodes by class</h3>{legend}{chart}</div>'
                    f'<div class="panel">{table}</div></div>{examples}')


def _examples(view: _View, label: str) -> str:
    by_class: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for suite, classes in view.results.get("examples", {}).get(label, {}).items():
        for cls, transcripts in classes.items():
            by_class.setdefault(cls, []).extend((suite, t) for t in transcripts)
    blocks = []
    for cls in FAILURE_CLASSES:
        if cls not in by_class:
            continue
        count = sum(view.suite(label, s["name"]).get("failures", {}).get(cls, 0) for s in view.suites)
        shown = "".join(_transcript(suite, t) for suite, t in by_class[cls])
        blocks.append(f'<details><summary><i class="dot" style="background:{FAILURE_COLORS[cls]}"></i> '
                      f'{FAILURE_LABELS[cls]} · {count} in {_e(label)}</summary><div class="body">{shown}</div>'
                      "</details>")
    return "".join(blocks)


def _transcript(suite: str, transcript: dict[str, Any]) -> str:
    details = " · ".join(f"{_e(k)}: {_e(v)}" for k, v in transcript.get("details", {}).items())
    messages = []
    for message in transcript.get("messages", []):
        role = message.get("role", "")
        text = message.get("content", "")
        if message.get("tool_calls"):
            text = f'{text}\n[tool calls] {message["tool_calls"]}'.strip()
        name = f' ({_e(message["name"])})' if message.get("name") else ""
        messages.append(f'<div class="msg {_e(role)}"><span class="role">{_e(role)}{name}</span><pre>{_e(text)}'
                        "</pre></div>")
    meta = (f'{_e(suite)} · {_e(transcript.get("task_id", ""))} · level {_e(transcript.get("difficulty", ""))} · '
            f'{_e(transcript.get("steps", 0))} step(s) · score {_e(transcript.get("score", 0))}')
    return (f'<div class="transcript"><div class="meta">{meta}</div>{"".join(messages)}'
            f'<div class="meta">{details}</div></div>')


def _contamination(view: _View) -> str:
    report = view.results.get("contamination", {})
    count, items = report.get("count", 0), report.get("eval_items", 0)
    sources = ", ".join(f"{_e(k)} ({v})" for k, v in report.get("sources", {}).items()) or "none given"
    statement = (f"<p><b>{count}</b> of {items} eval items were found in the {report.get('training_records', 0)} "
                 f"training records checked (sources: {sources}): for generated items, the same problem (task id) "
                 f"or prompt; for dataset and regression items, a shared {report.get('ngram', 13)}-token n-gram or "
                 "the same prompt. " + ("They were <b>excluded</b> from their suites." if report.get("excluded")
                                        else "They were kept." if count else "") + "</p>")
    if not report.get("training_records"):
        statement += '<p class="note">No training data was named (recipe <code>contamination</code>), so ' \
                     "nothing was checked.</p>"
    listed = report.get("items", [])[:MAX_CONTAMINATED_ROWS]
    table = _table(["suite", "eval item", "why", "records", "training examples"], [
        [_e(r["suite"]), _e(r["prompt"]), _e(", ".join(r["reasons"])), str(r["records"]),
         "<br>".join(f'{_e(t["source"])}: {_e(t["prompt"])}' for t in r["training"])] for r in listed],
        text_columns=(1, 4)) if listed else ""
    more = len(report.get("items", [])) - MAX_CONTAMINATED_ROWS
    if more > 0:
        table += f'<p class="muted">{more} more in results.json.</p>'
    return _section("contamination", "Contamination", "", f'<div class="panel">{statement}{table}</div>')


def _hygiene(view: _View) -> str:
    rows = view.results.get("hygiene", [])
    if not rows:
        return ""
    table = _table(["suite", "items", "outside the held-out split", "examples"], [
        [_e(r["suite"]), str(r["items"]), (f'<span class="{"fail" if r["outside_heldout"] else "ok"}">'
                                           f'{r["outside_heldout"]}</span>'),
         _e(", ".join(r.get("examples", [])))] for r in rows])
    lead = ("Generated domains split problems into train and held-out by a hash of the problem, so a training draw "
            "never holds a held-out problem. Every generated item is re-checked here: none may fall outside the "
            "held-out side.")
    return _section("hygiene", "Held-out hygiene", lead, f'<div class="panel">{table}</div>')


def _regressions(view: _View) -> str:
    rows = view.results.get("regressions", [])
    if not rows:
        return ""
    status = {True: '<span class="ok">pass</span>', False: '<span class="fail">below the floor</span>', None: "–"}
    table = _table(["suite", "checkpoint", "pass@1", "floor", "status"],
                   [[_e(r["suite"]), _e(r["checkpoint"]), _pct(r["pass_rate"]), _pct(r["min_pass_rate"]),
                     status[r["ok"]]] for r in rows])
    return _section("regressions", "Regression suites", "Fixed task sets with a pass-rate floor.",
                    f'<div class="panel">{table}</div>')


def _tiers(view: _View) -> str:
    table = view.results.get("tiers") or {}
    rows = table.get("rows") or []
    if not rows:
        return ""
    baseline = table.get("baseline")
    cells = []
    for row in rows:
        quantization = row.get("quantization") or {}
        engine = row.get("engine") or {}
        options = engine.get("options") or {}
        how = " · ".join([_e(row.get("runner") or engine.get("runner") or "")]
                         + ([_e(quantization.get("target") or quantization.get("library"))] if quantization else [])
                         + ([_e(json.dumps(options))] if options else []))
        accepted = row.get("acceptance_rate")
        cells.append([
            f'<i class="dot" style="background:{view.colors.get(row["label"], "#999")}"></i> {_e(row["label"])}',
            _e(row.get("kind")), _pct(row.get("accuracy")),
            _delta(row.get("accuracy"), None if row["label"] == baseline else _baseline(rows, baseline, "accuracy")),
            _num(row.get("tokens_per_s"), 1), _ratio(row.get("speedup")), _num(row.get("p50_latency_ms"), 0),
            _num(row.get("p90_latency_ms"), 0), _num(row.get("ms_per_token"), 1),
            _pct(accepted) if accepted is not None else "–", how])
    head = ["tier", "kind", "accuracy", "Δ pp", "tokens / s", "speed-up", "p50 ms", "p90 ms", "ms / token",
            "accepted", "engine"]
    by_speed = [(r["label"], r["tokens_per_s"], r["accuracy"]) for r in rows if r.get("accuracy") is not None]
    by_latency = [(r["label"], r["p50_latency_ms"], r["accuracy"]) for r in rows if r.get("accuracy") is not None]
    speed_chart = scatter_chart(by_speed, label="accuracy against tokens/s", x_label="tokens / s",
                                y_label="accuracy", colors=view.colors)
    latency_chart = scatter_chart(by_latency, label="accuracy against p50 latency", x_label="p50 latency (ms)",
                                  y_label="accuracy", colors=view.colors)
    charts = (f'<div class="grid" style="margin-top:16px"><div class="panel">{speed_chart}</div>'
              f'<div class="panel">{latency_chart}</div></div>')

    settings = table.get("settings") or {}
    suites = ", ".join(table.get("accuracy_suites") or []) or "–"
    lead = (f"Accuracy is pass@1 over <b>{_e(suites)}</b>; speed is greedy decoding of the same "
            f"{_e(settings.get('prompts'))} held-out prompts, one request at a time, at most "
            f"{_e(settings.get('max_new_tokens'))} new tokens, {_e(settings.get('repeats'))} timed passes. "
            f"Speed-up and Δ are against <b>{_e(baseline)}</b>.")
    return _section("tiers", "Tiers", lead, f'<div class="panel">{_table(head, cells, text_columns=(10,))}</div>'
                    f'{charts}')


def _baseline(rows: list[dict[str, Any]], label: str | None, key: str) -> float | None:
    return next((row.get(key) for row in rows if row["label"] == label), None)


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _settings(view: _View) -> str:
    results = view.results
    table = _table(["checkpoint", "path", "items", "episodes", "cached", "seconds", "items / s", "load s"], [
        [f'<i class="dot" style="background:{view.colors[c["label"]]}"></i> {_e(c["label"])}', _e(c["path"]),
         str(c.get("items", "")), str(c.get("episodes", "")), str(c.get("cached_episodes") or 0),
         _num(c.get("seconds"), 1),
         _num(c.get("items_per_s"), 1), _num(c.get("load_seconds"), 1)] for c in results.get("checkpoints", [])],
        text_columns=(1,))
    sampling = _e(json.dumps(results.get("sampling", {})))
    recipe = _e(json.dumps(results.get("recipe", {}), indent=1))
    return _section("settings", "Settings", f"Sampling: <code>{sampling}</code>",
                    f'<div class="panel">{table}</div><details><summary>recipe</summary><div class="body">'
                    f'<pre class="config">{recipe}</pre></div></details>')


# ---- small pieces -----------------------------------------------------------------------------------------


def _section(anchor: str, title: str, lead: str, content: str) -> str:
    lead_html = f'<p class="lead">{lead}</p>' if lead else ""
    return f'<section id="{anchor}"><h2>{_e(title)}</h2>{lead_html}{content}</section>'


def _table(head: list[str], rows: list[list[str]], text_columns: tuple[int, ...] = ()) -> str:
    """A table of cells that are already HTML (escaped by the caller); `text_columns` wrap instead of scrolling."""
    header = "".join(f"<th>{cell}</th>" for cell in head)
    body = "".join("<tr>" + "".join(f'<td class="text">{cell}</td>' if i in text_columns else f"<td>{cell}</td>"
                                    for i, cell in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{header}</tr>{body}</table>"


def _card(title: str, value: str, detail: str) -> str:
    return f'<div class="card"><div class="k">{_e(title)}</div><div class="v">{value}</div><div class="d">{detail}</div></div>'


def _kind(view: _View, name: str) -> str:
    return next((s["kind"] for s in view.suites if s["name"] == name), "")




def _num(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _delta(value: float | None, before: float | None, higher_is_better: bool = True, percent: bool = True) -> str:
    if value is None or before is None:
        return ""
    change = (value - before) * (100 if percent else 1)
    if abs(change) < (0.05 if percent else 5e-4):
        return '<span class="delta same">±0</span>'
    good = (change > 0) == higher_is_better
    text = f"{change:+.1f}" if percent else f"{change:+.3f}"
    return f'<span class="delta {"up" if good else "down"}">{text}</span>'


def _gap(value: float | None, noise: float | None) -> str:
    if value is None:
        return "–"
    cls = "fail" if value > (noise if noise is not None else 0.05) else "muted"
    return f'<span class="{cls}">{value * 100:+.1f} pp</span>'
