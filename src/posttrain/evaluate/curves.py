"""Training curves for the report, read from a run's metrics.jsonl (`posttrain.tracking.read_metrics`).

A run's metric names are grouped into panels by their prefix: reward (``reward/<domain>``, ``reward/mean``),
pass rate (``pass_rate/<domain>``, ``reward/pass_rate``), held-out accuracy (``heldout/<domain>``), curriculum
level (any name with ``level`` or ``curriculum`` in it), KL (``train/kl*``), entropy (``train/entropy*``) and
loss (``train/loss``, ``heldout/loss`` ...). Long series are thinned to `MAX_POINTS` evenly spaced points
(the last one always kept).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Sequence

from posttrain.tracking import METRICS_FILE, read_metrics

MAX_POINTS = 300

# (panel title, test on the metric name, values are fractions in [0, 1])
PANELS: list[tuple[str, Any, bool]] = [
    ("Loss", lambda name: name.split("/")[-1].endswith("loss") and not name.startswith("time/"), False),
    ("Reward", lambda name: name.startswith("reward/") and name != "reward/pass_rate", False),
    ("Pass rate", lambda name: name.startswith("pass_rate/") or name == "reward/pass_rate", True),
    ("Held-out accuracy", lambda name: name.startswith("heldout/") and not name.endswith("loss"), True),
    ("Curriculum level", lambda name: re.search(r"curriculum|(^|/)level", name) is not None, False),
    ("KL", lambda name: name.startswith("train/kl"), False),
    ("Entropy", lambda name: name.startswith("train/entropy"), False),
]


def metrics_path(location: str | Path) -> Path:
    path = Path(location)
    return path / METRICS_FILE if path.is_dir() else path


def training_curves(runs: Sequence[tuple[str, str | Path]]) -> list[dict[str, Any]]:
    """Panels for every (label, run directory or metrics.jsonl) that has metrics: one dict per panel with
    ``run``, ``title``, ``fraction`` and ``series`` (metric name -> [[step, value], ...])."""
    panels = []
    for label, location in runs:
        records = read_metrics(metrics_path(location))
        if not records:
            continue
        series = _series(records)
        taken: set[str] = set()
        for title, wanted, fraction in PANELS:
            names = sorted(name for name in series if name not in taken and wanted(name))
            if not names:
                continue
            taken.update(names)
            panels.append({"run": label, "title": title, "fraction": fraction,
                           "series": {name: _thin(series[name]) for name in names}})
    return panels


def _series(records: list[dict[str, Any]]) -> dict[str, list[list[float]]]:
    series: dict[str, list[list[float]]] = {}
    for record in records:
        step = record.get("step")
        if not isinstance(step, (int, float)):
            continue
        for name, value in record.items():
            if name in ("step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(float(value)):
                series.setdefault(name, []).append([float(step), float(value)])
    return series


def _thin(points: list[list[float]]) -> list[list[float]]:
    if len(points) <= MAX_POINTS:
        return points
    stride = (len(points) - 1) / (MAX_POINTS - 1)
    return [points[round(i * stride)] for i in range(MAX_POINTS)]
