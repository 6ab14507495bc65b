"""The loop skeleton every supervised recipe shares: steps over epochs, time budget, metric window, eval, save.

    cursor = train_loop("sft", recipe.train, cursor, total_steps, epoch_items=data.epoch_rows, step=one_step,
                        scheduler=scheduler, tracker=tracker, save=save, evaluate=evaluate, progress=describe)

A recipe brings what is its own: `epoch_items(epoch)` (the epoch's rows or pair indices, a pure function of the
seed and the epoch, so a resume replays the order exactly; anything sliced by `items[a:b]`) and `step(items)`, one optimizer step over a batch of
them (forward, backward, the optimizer step) that reports its `StepFigures`. The loop owns the rest, written once:

- stop at `total_steps`, or when `train.max_minutes` of training time is spent (time in steps only, so a resume
  continues the budget) -- a safety cap, so it warns: where it cuts a run short the outcome depends on the
  machine's speed and load; `cursor.stopped_by` says which ended the run ("steps", "time_cap", "early_stopping");
- roll over to the next epoch when its items run out (a step never spans two epochs: the last one is short).
  The end of an epoch is found by reading past it (an empty slice), never by counting it: `epoch_items` may be a
  list or a stream read by forward slices (`posttrain.data.RowStream`), which has no `len` -- counting a stream
  would cost a pass over the data;
- every `log_every` steps, log the window's means (`sums / weight` over the steps since the last log: token-
  weighted for SFT, per pair for DPO and RM), grad norm, learning rate, throughput and epoch position;
- every `eval_every` steps, `evaluate()`, which returns True to stop early; every `save_every` steps, `save()`
  (not at the last step: the recipe saves the finished run itself).

The `Cursor` is the whole of the loop's state: saved in each checkpoint, it resumes the loop exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from posttrain.tracking import say


@dataclass
class Cursor:
    """Where a run is: optimizer steps taken, the next item of which epoch, training time, items and tokens
    trained, and early stopping's best held-out score so far (where, and evaluations since)."""

    step: int = 0
    epoch: int = 0
    row: int = 0
    train_seconds: float = 0.0
    samples: int = 0
    tokens: int = 0
    best_score: float | None = None
    best_step: int = 0
    evals_since_best: int = 0
    stopped_by: str = ""  # why the loop ended: "steps", "time_cap" or "early_stopping" ("" while it runs)


@dataclass
class StepFigures:
    """What one optimizer step reports to the loop."""

    loss: float  # the step's loss (what `on_step` sees)
    grad_norm: float
    weight: float  # the normalizer of the window's means: trained tokens (SFT), pairs (DPO, RM)
    tokens: int  # input tokens of the step (throughput)
    sums: dict[str, float] = field(default_factory=dict)  # summed statistics, logged as sums / weight
    peaks: dict[str, float] = field(default_factory=dict)  # logged as their largest value over the window


@dataclass
class SFTResult:
    output_dir: Path
    final_dir: Path
    steps: int
    seconds: float
    tokens_per_s: float
    train_loss: float
    heldout_loss: float | None
    data_report: dict[str, Any] = field(default_factory=dict)
    stopped_by: str = ""  # "epochs", "max_steps", "early_stopping" or "time_cap"
    tokens: int = 0  # input tokens trained on (every step's forward and backward)
    evaluation: dict[str, float] = field(default_factory=dict)  # the last evaluation's figures (eval/...)


def train_loop(
    stage: str,
    config: Any,
    cursor: Cursor,
    total_steps: int,
    *,
    epoch_items: Callable[[int], Sequence[Any]],
    step: Callable[[list[Any]], StepFigures],
    scheduler: Any,
    tracker: Any,
    save: Callable[[], None],
    evaluate: Callable[[], bool] | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    progress: Callable[[dict[str, float]], str] | None = None,
    rate_name: str | None = None,
) -> float:
    """Run steps from `cursor` (advanced in place) to `total_steps`; the last step's loss.

    `config` is a recipe's `train:` section (batch_size, max_minutes, log_every, eval_every, save_every);
    `rate_name` adds ``train/<rate_name>``, items per second; `progress(metrics)` is the progress bar's text."""
    items = epoch_items(cursor.epoch)
    window = _Window()
    last_loss = float("nan")
    tracker.start_progress(total_steps, done=cursor.step)
    cursor.stopped_by = "steps"
    while cursor.step < total_steps:
        if config.max_minutes is not None and cursor.train_seconds >= config.max_minutes * 60:
            say(f"[{stage}] WARNING: the time cap of {config.max_minutes} min cut training short at step "
                f"{cursor.step} of {total_steps}: the result now depends on this machine's speed and load")
            cursor.stopped_by = "time_cap"
            break
        batch = list(items[cursor.row : cursor.row + config.batch_size])
        if not batch:  # read past the epoch's end: the next epoch starts
            cursor.epoch, cursor.row = cursor.epoch + 1, 0
            items = epoch_items(cursor.epoch)
            batch = list(items[0 : config.batch_size])
            if not batch:
                raise ValueError(f"[{stage}] epoch {cursor.epoch} has no items to train on")
        started = time.perf_counter()
        figures = step(batch)
        cursor.train_seconds += time.perf_counter() - started
        cursor.step += 1
        cursor.row += len(batch)
        cursor.samples += len(batch)
        cursor.tokens += figures.tokens
        window.add(figures, len(batch))
        last_loss = figures.loss
        if on_step is not None:
            on_step(cursor.step, {"loss": figures.loss, "grad_norm": figures.grad_norm})
        if cursor.step % config.log_every == 0 or cursor.step == total_steps:
            metrics = window.metrics(figures.grad_norm, scheduler.get_last_lr()[0], rate_name)
            length = _known_length(items)
            metrics["train/epoch"] = cursor.epoch + (cursor.row / max(length, 1) if length is not None else 0.0)
            tracker.log(metrics, step=cursor.step)
            tracker.advance(cursor.step, progress(metrics) if progress else "")
            window = _Window()
        if config.eval_every and cursor.step % config.eval_every == 0 and evaluate is not None:
            if evaluate():
                cursor.stopped_by = "early_stopping"
                break
        if config.save_every and cursor.step % config.save_every == 0 and cursor.step < total_steps:
            save()
    return last_loss


def count_items(items: Any) -> int:
    """An epoch's length for a recipe that must know it before training (to size the LR schedule from
    `train.epochs`): a list's `len`, a stream's `count()` -- a pass over the data, so only when asked."""
    return len(items) if hasattr(items, "__len__") else items.count()


def _known_length(items: Any) -> int | None:
    """The epoch's length where it is known without a pass: a list's, or a stream's once read to its end."""
    if hasattr(items, "known_length"):
        return items.known_length
    return len(items) if hasattr(items, "__len__") else None


class _Window:
    """The steps since the last log line."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.peaks: dict[str, float] = {}
        self.weight, self.samples, self.tokens = 0.0, 0, 0
        self.started = time.perf_counter()

    def add(self, figures: StepFigures, samples: int) -> None:
        for key, value in figures.sums.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        for key, value in figures.peaks.items():
            self.peaks[key] = max(self.peaks.get(key, value), value)
        self.weight += figures.weight
        self.samples += samples
        self.tokens += figures.tokens

    def metrics(self, grad_norm: float, lr: float, rate_name: str | None) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        metrics = {f"train/{key}": value / max(self.weight, 1) for key, value in self.sums.items()}
        metrics.update({f"train/{key}": value for key, value in self.peaks.items()})
        metrics.update({"train/grad_norm": grad_norm, "train/lr": lr})
        if rate_name is not None:
            metrics[f"train/{rate_name}"] = self.samples / elapsed
        metrics["train/tokens_per_s"] = self.tokens / elapsed
        return metrics
