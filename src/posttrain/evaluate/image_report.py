"""The report's image section: per-domain pass@1 of image suites, checkpoints side by side, and thumbnails of the
bad cases (the image the model saw, the question, the expected answer and the model's answer).

The results JSON holds ``images``: ``{checkpoint label: {suite name: image_suite_json(score)}}``. A thumbnail is
written only when it is a PNG ``data:`` URL (`posttrain.evaluate.images.thumbnail`), so the file stays
self-contained and nothing else can reach an ``<img src>``; every text is escaped.
"""

from __future__ import annotations

import html
import re
from typing import Any

MAX_BAD_CASES = 24
MAX_SAMPLES = 8  # per suite: the first cases, right or wrong, shown with the model's answers
_PNG_DATA_URL = re.compile(r"data:image/png;base64,[A-Za-z0-9+/=]+")


def image_suite_json(score: Any, max_cases: int = MAX_BAD_CASES, max_samples: int = MAX_SAMPLES) -> dict[str, Any]:
    """An `ImageSuiteScore` as results JSON: pass@1, per domain, the first `max_samples` cases (right or wrong)
    and the first `max_cases` failed cases."""
    keep = ("task_id", "domain", "difficulty", "question", "expected", "answer", "passed", "thumbnail")
    return {"pass@1": score.pass_at_1, "per_domain": dict(score.per_domain), "items": len(score.cases),
            "samples": [{key: getattr(case, key) for key in keep} for case in score.cases[:max_samples]],
            "bad_cases": [{key: getattr(case, key) for key in keep} for case in score.failures[:max_cases]]}


def image_section(images: dict[str, dict[str, Any]]) -> str:
    """The ``<section id="images">`` for the report ("" when no checkpoint has an image suite)."""
    if not images:
        return ""
    labels = list(images)
    suites = list(dict.fromkeys(name for label in labels for name in images[label]))
    rows = []
    for name in suites:
        domains = list(dict.fromkeys(d for label in labels for d in images[label].get(name, {}).get("per_domain", {})))
        rows.append([f"<b>{_e(name)}</b> (all)"] + [_pct(images[l].get(name, {}).get("pass@1")) for l in labels])
        rows += [[f"&nbsp;&nbsp;{_e(d)}"] + [_pct(images[l].get(name, {}).get("per_domain", {}).get(d))
                                              for l in labels] for d in domains]
    head = "".join(f"<th>{_e(cell)}</th>" for cell in ["suite / domain", *labels])
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    last = labels[-1]
    samples = [case for name in suites for case in images[last].get(name, {}).get("samples", [])]
    shown = "".join(_case(case) for case in samples)
    shown = f'<h3>Sample images with the answers of {_e(last)}</h3><div class="images">{shown}</div>' if shown else ""
    cases = [case for name in suites for case in images[last].get(name, {}).get("bad_cases", [])]
    figures = "".join(_case(case) for case in cases[:MAX_BAD_CASES])
    gallery = (f'<h3>Bad cases of {_e(last)}</h3><div class="images">{figures}</div>' if figures
               else f'<p class="muted">{_e(last)} answered every image right.</p>')
    return (f'<section id="images"><h2>Images</h2><p class="lead">pass@1 on image tasks per domain; below, sample '
            f'images with the last checkpoint\'s answers, then the images it answered wrong.</p><div class="panel">'
            f'<table><tr>{head}</tr>{body}</table></div>{shown}{gallery}</section>')


def _case(case: dict[str, Any]) -> str:
    source = case.get("thumbnail", "")
    image = f'<img src="{source}" alt="{_e(case.get("task_id"))}">' if _PNG_DATA_URL.fullmatch(source) else ""
    return (f'<figure style="display:inline-block;margin:6px;width:160px;vertical-align:top">{image}'
            f'<figcaption><span class="muted">{_e(case.get("domain"))} L{_e(case.get("difficulty"))}</span><br>'
            f'{_e(case.get("question"))}<br>expected <b>{_e(case.get("expected"))}</b>, answered '
            f'<b class="{"ok" if case.get("passed") else "fail"}">{_e(case.get("answer")) or "(nothing)"}</b>'
            '</figcaption></figure>')


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"
