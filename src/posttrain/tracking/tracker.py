"""The run's tracker: fans metrics out to the sinks and drives the progress display.

On a terminal the display is a rich progress bar with tokens/s and ETA; elsewhere (CI, a pipe) it prints
a plain line every `log_every` steps, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from posttrain.config import TrackingConfig
from posttrain.tracking.sinks import JSONLSink, MetricsSink, MLflowSink, TensorBoardSink, WandbSink

console = Console(stderr=True)
METRICS_FILE = "metrics.jsonl"  # in the run's output_dir, always written
TENSORBOARD_DIR = "tensorboard"  # beside it, with tracking.tensorboard


class Tracker:
    def __init__(
        self,
        output_dir: Path,
        config: TrackingConfig,
        *,
        recipe: dict[str, Any] | None = None,
        stage: str = "train",
    ):
        self.output_dir = Path(output_dir)
        self.stage = stage
        self.sinks: list[MetricsSink] = [JSONLSink(self.output_dir / METRICS_FILE)]
        if config.tensorboard:
            self.sinks.append(TensorBoardSink(self.output_dir / TENSORBOARD_DIR))
        if config.wandb:
            self.sinks.append(WandbSink(config.project, config.run_name, recipe or {}))
        if config.mlflow:
            self.sinks.append(MLflowSink(config.project, config.run_name, recipe or {}))
        self._show_bar = config.progress and sys.stderr.isatty()
        self._progress: Progress | None = None
        self._task = None
        self._last_line = 0.0

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def start_progress(self, total_steps: int | None, done: int = 0) -> None:
        if not self._show_bar:
            return
        self._progress = Progress(
            TextColumn(f"[bold]{self.stage}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task(self.stage, total=total_steps, completed=done, status="")

    def advance(self, step: int, status: str) -> None:
        """Update the bar (terminal) or print a line at most every 10 s (pipes)."""
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=status)
        elif time.monotonic() - self._last_line > 10:
            self._last_line = time.monotonic()
            say(f"[{self.stage}] step {step} {status}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        for sink in self.sinks:
            sink.close()


def say(message: str) -> None:
    """Print a status line to stderr as is (no rich markup: "[sft]" prefixes are text, not styles)."""
    console.print(message, markup=False, highlight=False, soft_wrap=True)
