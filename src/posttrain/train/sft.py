"""The SFT recipe, top to bottom: recipe -> model -> data -> loop -> checkpoint.

    posttrain sft recipe.yaml optim.lr=3e-4 [--resume]

Loss: mean cross-entropy over assistant tokens of the whole optimizer batch (see `train.losses`).
A run resumes exactly: the data order is a pure function of (seed, epoch), so the checkpoint stores only
the cursor (epoch, row), plus optimizer, schedule and RNG states.

Sharded over processes (`posttrain.distributed`: a torchrun launch or Ray actors), every rank runs this same
function with a `DataParallel`: the model is sharded after its weights are loaded, each rank trains on its share
of every step's rows (the loss normalized by the whole step's tokens, gradients summed across ranks), and rank 0
alone writes metrics and checkpoints, in the same format as a one-process run.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from posttrain.config import SFTRecipe, dump_recipe
from posttrain.data import PreparedSFTData, collate, prepare_sft_data, read_all_texts
from posttrain.models import (
    count_parameters,
    latest_checkpoint,
    load_model,
    load_tokenizer,
    load_training_state,
    load_weights_from_checkpoint,
    restore_rng,
    save_checkpoint,
    save_model_dir,
)
from posttrain.tracking import Tracker, say
from posttrain.train.forward import check_forward_parity
from posttrain.train.losses import sft_loss_sum
from posttrain.train.optim import build_optimizer, build_scheduler, load_optimizer_state
from posttrain.train.step import Runtime, optimizer_step, prepare_model, setup_runtime


class DataParallel(Protocol):
    """What a sharded run plugs in (implemented over torch.distributed by `posttrain.distributed`)."""

    rank: int

    def shard_model(self, model: torch.nn.Module, mode: str = "auto") -> torch.nn.Module: ...

    def reduce_gradients(self, model: torch.nn.Module) -> None: ...

    def micro_batches(self, items: list[Any], micro_batch_size: int) -> list[list[Any]]:
        """This rank's micro-batches of a step: the same count on every rank, some possibly empty."""
        ...

    def idle_backward(self, model: torch.nn.Module) -> None: ...

    def all_gather(self, value: Any) -> list[Any]: ...

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The optimizer state in one process's format on rank 0 (None elsewhere); every rank must call it."""
        ...

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None: ...

    def full_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """An unsharded model with the current weights on rank 0 (None elsewhere); every rank must call it."""
        ...


class _Silent:
    """The tracker of a rank that does not write (every rank but 0 of a sharded run)."""

    def log(self, *args, **kwargs) -> None:
        pass

    start_progress = advance = close = log


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


@dataclass
class _Cursor:
    """Where the run is: optimizer steps taken, and the next row of which epoch."""

    step: int = 0
    epoch: int = 0
    row: int = 0
    train_seconds: float = 0.0
    tokens: int = 0
    best_score: float | None = None  # early stopping: the best held-out score so far, where, and since when
    best_step: int = 0
    evals_since_best: int = 0


def run_sft(
    recipe: SFTRecipe,
    *,
    resume: bool = False,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    parallel: DataParallel | None = None,
    evaluate: Callable[[torch.nn.Module], dict[str, float]] | None = None,
) -> SFTResult:
    output_dir = Path(recipe.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    writer = parallel is None or parallel.rank == 0
    if writer:
        (output_dir / "recipe.yaml").write_text(dump_recipe(recipe))
    runtime = setup_runtime(recipe.runtime)

    # Model and data. The built-in tokenizer (no model.path) is trained on the run's own text.
    corpus = read_all_texts(recipe.data) if recipe.model.path is None and not recipe.model.tokenizer_path else None
    tokenizer = load_tokenizer(recipe.model, corpus=corpus)
    rejects_dir = output_dir if writer else Path(tempfile.mkdtemp(prefix="posttrain-rejects-"))
    data = prepare_sft_data(recipe.data, tokenizer, seed=recipe.runtime.seed, rejects_dir=rejects_dir)
    model = load_model(recipe.model, tokenizer, runtime.device)
    model = prepare_model(model, recipe.model, recipe.runtime)
    check_forward_parity(model, data.epoch_rows(0), runtime.autocast_dtype, layout="packed", what="sft")
    checkpoint = latest_checkpoint(output_dir) if resume else None
    if checkpoint is not None:
        load_weights_from_checkpoint(model, checkpoint)  # before sharding: the checkpoint holds whole tensors
    if parallel is not None:
        model = parallel.shard_model(model, recipe.cluster.data_parallel)

    rows_per_epoch = len(data.epoch_rows(0))
    steps_per_epoch = max(1, math.ceil(rows_per_epoch / recipe.train.batch_size))
    total_steps = recipe.train.max_steps or math.ceil(recipe.train.epochs * steps_per_epoch)
    optimizer = build_optimizer(model, recipe.optim)
    scheduler = build_scheduler(optimizer, recipe.optim, total_steps)

    cursor = _Cursor()
    if checkpoint is not None:
        state = load_training_state(checkpoint)
        if parallel is not None:
            parallel.load_optimizer_state(optimizer, state["optimizer"])
        else:
            load_optimizer_state(optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        cursor = _Cursor(**state["cursor"])
        restore_rng(state["rng"])
        say(f"[sft] resumed from {checkpoint} at step {cursor.step}")
    elif resume:
        say(f"[sft] --resume: no checkpoint in {output_dir}, starting fresh")

    tracker = Tracker(output_dir, recipe.tracking, recipe=recipe.model_dump(mode="json"), stage="sft") \
        if writer else _Silent()
    if cursor.step == 0:
        tracker.log({f"data/{k}": v for k, v in _flat(data.report).items()}, step=0)
    if writer:
        say(
            f"[sft] {count_parameters(model, trainable_only=True):,} trainable parameters, {rows_per_epoch} "
            f"rows/epoch, {total_steps} steps, {runtime.precision} on {runtime.device}"
        )
    if evaluate is not None and parallel is not None:
        raise ValueError("run_sft: an evaluate callback runs in one process; not with data parallelism")
    train_loss = _train_loop(recipe, model, tokenizer, data, optimizer, scheduler, runtime, cursor, total_steps,
                             tracker, on_step, output_dir, parallel, evaluate)
    heldout_loss = evaluate_loss(model, data.heldout_rows(), tokenizer.pad_token_id, runtime,
                                 recipe.train.batch_size) if data.has_heldout else None
    if heldout_loss is not None:
        tracker.log({"eval/heldout_loss": heldout_loss}, step=cursor.step)
    _save(recipe, output_dir, model, tokenizer, optimizer, scheduler, cursor, parallel)
    final_dir = output_dir / "final"
    whole = model if parallel is None else parallel.full_model(model)
    if whole is not None:
        save_model_dir(final_dir, whole, tokenizer, merge_lora=True)
    tracker.close()
    return SFTResult(
        output_dir=output_dir,
        final_dir=final_dir,
        steps=cursor.step,
        seconds=cursor.train_seconds,
        tokens_per_s=cursor.tokens / max(cursor.train_seconds, 1e-9),
        train_loss=train_loss,
        heldout_loss=heldout_loss,
        data_report=data.report,
    )


def _train_loop(recipe, model, tokenizer, data: PreparedSFTData, optimizer, scheduler, runtime: Runtime,
                cursor: _Cursor, total_steps: int, tracker: Tracker, on_step, output_dir: Path,
                parallel: DataParallel | None = None, evaluate=None) -> float:
    config = recipe.train
    micro = config.micro_batch_size or config.batch_size
    rows = data.epoch_rows(cursor.epoch)
    window_loss, window_tokens, window_trained, window_start = 0.0, 0, 0, time.perf_counter()
    last_loss = float("nan")
    tracker.start_progress(total_steps, done=cursor.step)
    model.train()
    while cursor.step < total_steps:
        if config.max_minutes is not None and cursor.train_seconds >= config.max_minutes * 60:
            say(f"[sft] time budget of {config.max_minutes} min reached at step {cursor.step}")
            break
        if cursor.row >= len(rows):
            cursor.epoch, cursor.row = cursor.epoch + 1, 0
            rows = data.epoch_rows(cursor.epoch)
        step_rows = rows[cursor.row : cursor.row + config.batch_size]
        started = time.perf_counter()
        if parallel is None:
            chunks = [step_rows[start : start + micro] for start in range(0, len(step_rows), micro)]
        else:
            chunks = parallel.micro_batches(step_rows, micro)  # this rank's share of the step
        batches = [collate(chunk, tokenizer.pad_token_id, device=runtime.device) if chunk else None
                   for chunk in chunks]
        trained_tokens = sum(int((b["labels"] != -100).sum()) for b in batches if b is not None)
        if parallel is not None:  # every rank divides by the whole step's tokens
            trained_tokens = sum(parallel.all_gather(trained_tokens))
        loss_sum, input_tokens = 0.0, 0
        for batch in batches:
            if batch is None:
                parallel.idle_backward(model)
                continue
            with runtime.autocast():
                summed, _ = sft_loss_sum(model, batch)
            (summed / max(trained_tokens, 1)).backward()
            loss_sum += float(summed.detach())
            input_tokens += batch["num_tokens"]
        if parallel is not None:
            parallel.reduce_gradients(model)
            parts = parallel.all_gather((loss_sum, input_tokens))
            loss_sum, input_tokens = sum(p[0] for p in parts), sum(p[1] for p in parts)
        grad_norm = optimizer_step(model, optimizer, scheduler, recipe.optim.max_grad_norm)
        cursor.train_seconds += time.perf_counter() - started
        cursor.step += 1
        cursor.row += len(step_rows)
        cursor.tokens += input_tokens
        last_loss = loss_sum / max(trained_tokens, 1)
        window_loss += loss_sum
        window_trained += trained_tokens
        window_tokens += input_tokens
        if on_step is not None:
            on_step(cursor.step, {"loss": last_loss, "grad_norm": grad_norm})
        if cursor.step % config.log_every == 0 or cursor.step == total_steps:
            elapsed = time.perf_counter() - window_start
            metrics = {
                "train/loss": window_loss / max(window_trained, 1),
                "train/grad_norm": grad_norm,
                "train/lr": scheduler.get_last_lr()[0],
                "train/tokens_per_s": window_tokens / max(elapsed, 1e-9),
                "train/epoch": cursor.epoch + cursor.row / max(len(rows), 1),
            }
            tracker.log(metrics, step=cursor.step)
            tracker.advance(cursor.step, f"loss {metrics['train/loss']:.4f} {metrics['train/tokens_per_s']:,.0f} tok/s")
            window_loss, window_tokens, window_trained, window_start = 0.0, 0, 0, time.perf_counter()
        if config.eval_every and cursor.step % config.eval_every == 0 and (data.has_heldout or evaluate):
            if _evaluate_and_check(model, tokenizer, data, runtime, config, cursor, tracker, evaluate):
                say(f"[sft] held-out score has not improved for {config.early_stopping_patience} evaluations: "
                    f"stopping at step {cursor.step} (best {cursor.best_score:.4f} at step {cursor.best_step})")
                break
        if config.save_every and cursor.step % config.save_every == 0 and cursor.step < total_steps:
            _save(recipe, output_dir, model, tokenizer, optimizer, scheduler, cursor, parallel)
    return last_loss


def _evaluate_and_check(model, tokenizer, data, runtime, config, cursor: _Cursor, tracker, evaluate) -> bool:
    """Log the held-out figures; True when early stopping says stop. The best score is in the cursor, so a
    resumed run stops where the uninterrupted one would."""
    metrics: dict[str, float] = {}
    if data.has_heldout:
        metrics["eval/heldout_loss"] = evaluate_loss(model, data.heldout_rows(), tokenizer.pad_token_id, runtime,
                                                     config.batch_size)
    if evaluate is not None:
        metrics.update({f"eval/{k}": v for k, v in evaluate(model).items()})
    model.train()
    tracker.log(metrics, step=cursor.step)
    score = metrics.get("eval/score", -metrics.get("eval/heldout_loss", 0.0))
    if cursor.best_score is None or score > cursor.best_score:
        cursor.best_score, cursor.best_step, cursor.evals_since_best = score, cursor.step, 0
    else:
        cursor.evals_since_best += 1
    patience = config.early_stopping_patience
    return patience is not None and cursor.evals_since_best >= patience


@torch.no_grad()
def evaluate_loss(model, rows, pad_id: int, runtime: Runtime, batch_size: int) -> float:
    """Mean token cross-entropy over the trained tokens of `rows` (held-out loss)."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = collate(rows[start : start + batch_size], pad_id, device=runtime.device)
        with runtime.autocast():
            summed, n = sft_loss_sum(model, batch)
        total += float(summed)
        count += n
    return total / max(count, 1)


def _save(recipe, output_dir, model, tokenizer, optimizer, scheduler, cursor: _Cursor,
          parallel: DataParallel | None = None) -> None:
    optimizer_state = optimizer.state_dict() if parallel is None else parallel.optimizer_state(optimizer)
    whole = model if parallel is None else parallel.full_model(model)
    if whole is None:  # not rank 0: it took part in gathering the state, rank 0 writes it
        return
    save_checkpoint(
        output_dir,
        cursor.step,
        whole,
        tokenizer,
        {"optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "cursor": vars(cursor).copy()},
        keep=recipe.train.keep_checkpoints,
    )


def _flat(report: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in report.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)):
            flat[f"{prefix}{key}"] = value
    return flat

