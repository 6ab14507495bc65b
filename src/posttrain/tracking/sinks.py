"""Metrics sinks: JSONL always; TensorBoard, Weights & Biases and MLflow when a recipe asks.

A sink is anything with `log(metrics, step)` and `close()`. Values that are not numbers are written to
JSONL only (TensorBoard and friends take scalars).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Protocol

from posttrain.types import PosttrainError


class TrackingError(PosttrainError):
    """A metrics backend the recipe asked for is not available."""


class MetricsSink(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


class JSONLSink:
    """One JSON object per line: {"step": s, "time": unix_s, ...metrics}. Appends, so a resumed run keeps
    everything the crashed one wrote (readers take the last value logged for a step)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, "time": round(time.time(), 3), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in metrics.items():
            if _is_scalar(value):
                self._writer.add_scalar(key, float(value), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(self, project: str, run_name: str | None, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise TrackingError("tracking.wandb is on but wandb is not installed: pip install wandb") from None
        self._run = wandb.init(project=project, name=run_name, config=config)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._run.log({k: v for k, v in metrics.items() if _is_scalar(v)}, step=step)

    def close(self) -> None:
        self._run.finish()


class MLflowSink:
    def __init__(self, project: str, run_name: str | None, config: dict[str, Any]):
        try:
            import mlflow
        except ImportError:
            raise TrackingError("tracking.mlflow is on but mlflow is not installed: pip install mlflow") from None
        self._mlflow = mlflow
        mlflow.set_experiment(project)
        mlflow.start_run(run_name=run_name)
        mlflow.log_params({k: str(v)[:250] for k, v in _flatten(config).items()})

    def log(self, metrics: dict[str, Any], step: int) -> None:
        scalars = {k.replace("/", "."): float(v) for k, v in metrics.items() if _is_scalar(v)}
        self._mlflow.log_metrics(scalars, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, keeping only the last record written for each (step, keys) —
    after a resume the re-run steps replace the crashed run's."""
    records: dict[tuple, dict[str, Any]] = {}
    path = Path(path)
    if not path.is_file():
        return []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        key = (record.get("step"), tuple(sorted(k for k in record if k not in ("step", "time"))))
        records[key] = record
    return sorted(records.values(), key=lambda r: (r.get("step", 0), r.get("time", 0)))


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    return value


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
