"""The SFT recipe, top to bottom: recipe -> model -> data -> loop -> checkpoint.

    posttrain sft recipe.yaml optim.lr=3e-4 [--resume]

Loss: mean cross-entropy over assistant tokens of the whole optimizer batch (see `train.losses`).
A run resumes exactly: the data order is a pure function of (seed, epoch), so the checkpoint stores only
the cursor (epoch, row), plus optimizer, schedule and RNG states.

Sharded over processes (`posttrain.distributed`: a torchrun launch or Ray actors), every rank runs this same
function with a `train.parallel.DataParallel` (one process: `LocalParallel`, which does nothing): the model is
sharded after its weights are loaded, each rank trains on its share of every step's rows (the loss normalized by
the whole step's tokens, gradients summed across ranks), and rank 0 alone writes metrics and checkpoints, in the
same format as a one-process run. The loop's skeleton is `train.loop.train_loop`; checkpoints are
`train.checkpoint`'s.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from posttrain.config import SFTRecipe
from posttrain.data import PreparedSFTData, collate, prepare_sft_data, read_all_texts
from posttrain.models import (
    count_parameters,
    load_model,
    load_tokenizer,
    load_weights_from_checkpoint,
    save_model_dir,
    wants_vision,
)
from posttrain.tracking import Tracker, say
from posttrain.train.context_parallel import check_context_parallel, context_parallel_sft_loss_sum, shard_batch
from posttrain.train.checkpoint import find_checkpoint, open_run_dir, restore_training, save_training
from posttrain.train.forward import check_forward_parity
from posttrain.train.losses import sft_loss_sum
from posttrain.train.memory import PeakMemory
from posttrain.train.loop import Cursor, SFTResult, StepFigures, count_items, train_loop
from posttrain.train.optim import build_optimizer, build_scheduler
from posttrain.train.parallel import LOCAL, DataParallel
from posttrain.train.sft_vision import run_vision_sft_recipe
from posttrain.train.step import Runtime, optimizer_step, prepare_model, setup_runtime


class _Silent:
    """The tracker of a rank that does not write (every rank but 0 of a sharded run)."""

    def log(self, *args, **kwargs) -> None:
        pass

    start_progress = advance = close = log


def run_sft(
    recipe: SFTRecipe,
    *,
    resume: bool = False,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    parallel: DataParallel = LOCAL,
    evaluate: Callable[[torch.nn.Module], dict[str, float]] | None = None,
) -> SFTResult:
    if wants_vision(recipe.model):  # chats with images, a vision-language policy: train.sft_vision
        if parallel.world_size > 1 or evaluate is not None:
            raise ValueError("run_sft: a vision-language policy trains in one process, without an evaluate callback")
        return run_vision_sft_recipe(recipe, resume=resume, on_step=on_step)
    writer = parallel.rank == 0
    output_dir = open_run_dir(recipe, "sft", resume, write_recipe=writer)
    runtime = setup_runtime(recipe.runtime)
    if evaluate is not None and parallel.world_size > 1:
        raise ValueError("run_sft: an evaluate callback runs in one process; not with data parallelism")
    context = recipe.cluster.context_parallel
    if context != (parallel.world_size if parallel.context_parallel else 1):
        raise ValueError(f"run_sft: cluster.context_parallel is {context} but this process runs in a group of "
                         f"{parallel.world_size} ({'context' if parallel.context_parallel else 'data'} parallel): "
                         "start context-parallel runs with `posttrain sft` or posttrain.distributed.launch_sft")

    # Model and data. The built-in tokenizer (no model.path) is trained on the run's own text.
    corpus = read_all_texts(recipe.data) if recipe.model.path is None and not recipe.model.tokenizer_path else None
    tokenizer = load_tokenizer(recipe.model, corpus=corpus)
    rejects_dir = output_dir if writer else Path(tempfile.mkdtemp(prefix="posttrain-rejects-"))
    data = prepare_sft_data(recipe.data, tokenizer, seed=recipe.runtime.seed, rejects_dir=rejects_dir)
    model = load_model(recipe.model, tokenizer, runtime.device)
    model = prepare_model(model, recipe.model, recipe.runtime)
    if parallel.context_parallel:
        check_context_parallel(model, recipe.data.max_length)  # an attention it cannot split: say so now
    check_forward_parity(model, data.epoch_rows(0), runtime.autocast_dtype, layout="packed", what="sft")
    checkpoint = find_checkpoint(output_dir, "sft") if resume else None
    if checkpoint is not None:
        load_weights_from_checkpoint(model, checkpoint)  # before sharding: the checkpoint holds whole tensors
    model = parallel.shard_model(model, recipe.cluster.data_parallel)

    # A streamed epoch has no length: it is counted (one pass) only when the schedule's length must come from
    # train.epochs; in training it ends where its data does.
    first_epoch = data.epoch_rows(0)
    streamed = not hasattr(first_epoch, "__len__")
    rows_per_epoch = None if streamed and recipe.train.max_steps else count_items(first_epoch)
    total_steps = recipe.train.max_steps or math.ceil(
        recipe.train.epochs * max(1, math.ceil(rows_per_epoch / recipe.train.batch_size)))
    optimizer = build_optimizer(model, recipe.optim)
    scheduler = build_scheduler(optimizer, recipe.optim, total_steps)
    state = None
    if checkpoint is not None:
        state = restore_training(checkpoint, "sft", optimizer=optimizer, scheduler=scheduler, parallel=parallel)
    cursor = Cursor(**state["cursor"]) if state else Cursor()

    tracker = Tracker(output_dir, recipe.tracking, recipe=recipe.model_dump(mode="json"), stage="sft") \
        if writer else _Silent()
    if cursor.step == 0:
        tracker.log({f"data/{k}": v for k, v in _flat(data.report).items()}, step=0)
    if writer:
        say(
            f"[sft] {count_parameters(model, trainable_only=True):,} trainable parameters, "
            f"{'streamed rows' if rows_per_epoch is None else f'{rows_per_epoch} rows/epoch'}, {total_steps} steps, {runtime.precision} on {runtime.device}"
        )

    def save() -> None:
        save_training(output_dir, model, tokenizer, optimizer=optimizer, scheduler=scheduler, cursor=cursor,
                      keep=recipe.train.keep_checkpoints, parallel=parallel)

    def step(rows: list) -> StepFigures:
        return _sft_step(model, rows, recipe, tokenizer.pad_token_id, optimizer, scheduler, runtime, parallel)

    last_eval: dict[str, Any] = {}

    def evaluate_and_check() -> bool:
        return _evaluate_and_check(model, tokenizer, data, runtime, recipe.train, cursor, tracker, evaluate,
                                   last_eval, parallel=parallel)

    model.train()
    train_loss = train_loop(
        "sft", recipe.train, cursor, total_steps, epoch_items=data.epoch_rows, step=step, scheduler=scheduler,
        tracker=tracker, save=save, evaluate=evaluate_and_check if (data.has_heldout or evaluate) else None,
        on_step=on_step,
        progress=lambda m: f"loss {m['train/loss']:.4f} {m['train/tokens_per_s']:,.0f} tok/s",
    )
    stopped_by = cursor.stopped_by
    if stopped_by == "steps":
        stopped_by = "max_steps" if recipe.train.max_steps else "epochs"
    if evaluate is not None and last_eval.get("step") != cursor.step:
        # The figures the run ended with, not those of an evaluation some steps before it stopped.
        _evaluate_and_check(model, tokenizer, data, runtime, recipe.train, cursor, tracker, evaluate, last_eval,
                            judge=False)
    heldout_loss = evaluate_loss(model, data.heldout_rows(), tokenizer.pad_token_id, runtime,
                                 recipe.train.batch_size, parallel) if data.has_heldout else None
    if heldout_loss is not None:
        tracker.log({"eval/heldout_loss": heldout_loss}, step=cursor.step)
        last_eval.setdefault("metrics", {})["eval/heldout_loss"] = heldout_loss
    if writer:
        say(stop_line(stopped_by, cursor, total_steps, recipe.train, last_eval.get("metrics", {})))
    save()
    final_dir = output_dir / "final"
    whole = parallel.full_model(model)
    if whole is not None:
        save_model_dir(final_dir, whole, tokenizer, merge_lora=recipe.model.lora.merge_on_save)
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
        stopped_by=stopped_by,
        tokens=cursor.tokens,
        evaluation=dict(last_eval.get("metrics", {})),
    )


def _sft_step(model, rows: list, recipe: SFTRecipe, pad_id: int, optimizer, scheduler, runtime: Runtime,
              parallel: DataParallel) -> StepFigures:
    """One optimizer step over `rows`: this rank's micro-batches, the loss normalized by the whole step's
    trained tokens (gathered over the ranks), gradients summed across ranks."""
    memory = PeakMemory(runtime.device)
    memory.start()
    micro = recipe.train.micro_batch_size or recipe.train.batch_size
    chunks = parallel.micro_batches(rows, micro)  # this rank's share of the step
    batches = [_rank_batch(chunk, pad_id, runtime, parallel) if chunk else None for chunk in chunks]
    local_trained = sum(b["trained_tokens"] for b in batches if b is not None)
    trained_tokens = sum(parallel.all_gather(local_trained))  # every rank divides by the whole step's tokens
    loss_sum, input_tokens = 0.0, 0
    for batch in batches:
        if batch is None:
            parallel.idle_backward(model)
            continue
        with runtime.autocast():
            summed, _ = _loss_sum(model, batch, parallel)
        (summed / max(trained_tokens, 1)).backward()
        loss_sum += float(summed.detach())
        input_tokens += batch["num_tokens"]
    parallel.reduce_gradients(model)
    parts = parallel.all_gather((loss_sum, input_tokens))
    loss_sum, input_tokens = sum(p[0] for p in parts), sum(p[1] for p in parts)
    grad_norm = optimizer_step(model, optimizer, scheduler, recipe.optim.max_grad_norm)
    largest = max((int(b["input_ids"].numel()) for b in batches if b is not None), default=0)
    return StepFigures(loss=loss_sum / max(trained_tokens, 1), grad_norm=grad_norm, weight=trained_tokens,
                       tokens=input_tokens, sums={"loss": loss_sum}, peaks=memory.figures(largest))


def _rank_batch(rows: list, pad_id: int, runtime: Runtime, parallel: DataParallel) -> dict[str, Any]:
    """This rank's tensors of a micro-batch: the collated rows, or under context parallelism its zigzag share
    of every row's tokens (`train.context_parallel.shard_batch`); with `trained_tokens`, its scored tokens."""
    batch = collate(rows, pad_id, device=runtime.device)
    if parallel.context_parallel:
        return shard_batch(batch, parallel.rank, parallel.world_size)
    batch["trained_tokens"] = int((batch["labels"] != -100).sum())
    return batch


def _loss_sum(model, batch: dict[str, Any], parallel: DataParallel) -> tuple[torch.Tensor, int]:
    if parallel.context_parallel:
        return context_parallel_sft_loss_sum(model, batch)
    return sft_loss_sum(model, batch)


def _evaluate_and_check(model, tokenizer, data: PreparedSFTData, runtime, config, cursor: Cursor, tracker,
                        evaluate, last: dict[str, Any], *, judge: bool = True, parallel: DataParallel = LOCAL) -> bool:
    """Log the held-out figures and print them; True when early stopping says stop. The best score is in the
    cursor, so a resumed run stops where the uninterrupted one would. `last` keeps the figures and their step;
    `judge=False` (the evaluation after the loop) leaves early stopping's state alone."""
    metrics: dict[str, float] = {}
    if data.has_heldout:
        metrics["eval/heldout_loss"] = evaluate_loss(model, data.heldout_rows(), tokenizer.pad_token_id, runtime,
                                                     config.batch_size, parallel)
    if evaluate is not None:
        metrics.update({f"eval/{k}": v for k, v in evaluate(model).items()})
    model.train()
    tracker.log(metrics, step=cursor.step)
    last.update(step=cursor.step, metrics=metrics)
    if not judge:
        say(f"[sft] step {cursor.step} (end): {describe_evaluation(metrics)}")
        return False
    score = metrics.get("eval/score", -metrics.get("eval/heldout_loss", 0.0))
    if cursor.best_score is None or score > cursor.best_score:
        cursor.best_score, cursor.best_step, cursor.evals_since_best = score, cursor.step, 0
    else:
        cursor.evals_since_best += 1
    say(f"[sft] step {cursor.step}: {describe_evaluation(metrics)}"
        f" (best {_score_text(cursor.best_score, metrics)} at step {cursor.best_step})")
    patience = config.early_stopping_patience
    stop = patience is not None and cursor.evals_since_best >= patience
    if stop:
        say(f"[sft] held-out score has not improved for {patience} evaluations: stopping at step {cursor.step} "
            f"(best {_score_text(cursor.best_score, metrics)} at step {cursor.best_step})")
    return stop


def describe_evaluation(metrics: dict[str, float]) -> str:
    """One console line of an evaluation: the validation accuracy (an `evaluate` callback's "score", with its
    per-domain "accuracy/<domain>") and the held-out loss, whichever the run has."""
    parts = []
    if "eval/score" in metrics:
        domains = [f"{k.removeprefix('eval/accuracy/')} {v:.1%}" for k, v in sorted(metrics.items())
                   if k.startswith("eval/accuracy/")]
        listed = f" ({', '.join(domains)})" if domains else ""
        parts.append(f"validation accuracy {metrics['eval/score']:.1%}{listed}")
    if "eval/heldout_loss" in metrics:
        parts.append(f"held-out loss {metrics['eval/heldout_loss']:.4f}")
    return "; ".join(parts) or "no held-out figures"


def _score_text(score: float | None, metrics: dict[str, float]) -> str:
    """Early stopping's score as a reader knows it: an accuracy, or (its negation) a held-out loss."""
    if score is None:
        return "-"
    return f"{score:.1%}" if "eval/score" in metrics else f"held-out loss {-score:.4f}"


STOP_REASONS = {
    "epochs": "all {epochs:g} epochs done",
    "max_steps": "train.max_steps reached",
    "early_stopping": "early stopping",
    "time_cap": "the time cap of {minutes:g} min cut it short (WARNING: the outcome depends on the machine's speed)",
}


def stop_line(stopped_by: str, cursor: Cursor, total_steps: int, config, metrics: dict[str, float]) -> str:
    """Why an SFT run stopped, at which step, and the held-out figures it reached."""
    reason = STOP_REASONS.get(stopped_by, stopped_by).format(epochs=config.epochs, minutes=config.max_minutes or 0)
    figures = describe_evaluation(metrics) if metrics else "no evaluation (no held-out data, no evaluate callback)"
    best = ""
    final = metrics.get("eval/score", -metrics.get("eval/heldout_loss", 0.0)) if metrics else None
    if cursor.best_score is not None and metrics and final < cursor.best_score:  # the model kept is the last one
        best = f"; an earlier evaluation was better: {_score_text(cursor.best_score, metrics)} at step {cursor.best_step}"
    return f"[sft] stopped: {reason}, at step {cursor.step} of {total_steps} planned; {figures}{best}"


@torch.no_grad()
def evaluate_loss(model, rows, pad_id: int, runtime: Runtime, batch_size: int,
                  parallel: DataParallel = LOCAL) -> float:
    """Mean token cross-entropy over the trained tokens of `rows` (held-out loss); under context parallelism
    every rank scores its share of the tokens and the sums are added up."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = _rank_batch(rows[start : start + batch_size], pad_id, runtime, parallel)
        with runtime.autocast():
            summed, n = _loss_sum(model, batch, parallel)
        total += float(summed)
        count += n
    if parallel.context_parallel:
        parts = parallel.all_gather((total, count))
        total, count = sum(p[0] for p in parts), sum(p[1] for p in parts)
    return total / max(count, 1)


def _flat(report: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in report.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)):
            flat[f"{prefix}{key}"] = value
    return flat

