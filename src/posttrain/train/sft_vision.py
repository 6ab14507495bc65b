"""The SFT recipe on chats with images, top to bottom: recipe -> image chats -> processor and model -> loop -> save.

    posttrain sft recipe.yaml model.vision=true          # the built-in tiny VLM; or model.path=<a VLM directory>

`run_sft` hands a recipe here when its policy is a vision-language model (`models.wants_vision`: ``model.vision``,
or a local ``model.path`` whose config has a ``vision_config``). The data are chats with OpenAI-style image parts
(`data.read_vision_sft_data`: a file relative to the data file, a ``data:`` URL, a datasets ``Image`` column); each
chat goes through the model's own processor once (`models.vision_inputs`: its chat template, its expansion of each
image into image tokens, its pixel preprocessing).

Loss: the cross-entropy summed over the step's assistant tokens, divided by their number (the text recipe's token
mean). Labels are the assistant turns only: the prompt, the image placeholder tokens the processor expanded and the
system turns are -100. The loop, logging, held-out loss, early stopping, checkpoints and exact resume are the text
recipe's (`train.loop.train_loop`, `train.checkpoint`); checkpoints and ``final/`` hold the processor beside the
weights, so `models.load_vision_model` (or plain transformers) reads them back.

Each chat is one row: no packing (``data.pack`` does not apply), and a chat longer than ``data.max_length`` with its
image tokens expanded is an error naming its record (never cut: a cut could split an image's tokens). What the
text recipe has and this one has not yet is refused up front (`check_vision_sft`).
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable, Sequence

import torch

from posttrain.config import ConfigError, SFTRecipe
from posttrain.data import DataError, VisionSample, read_vision_sft_data
from posttrain.models import (
    ModelError,
    count_parameters,
    load_weights_from_checkpoint,
    save_model_dir,
    vision_inputs,
)
from posttrain.tracking import Tracker, say
from posttrain.train.checkpoint import find_checkpoint, restore_training, save_training
from posttrain.train.loop import Cursor, SFTResult, StepFigures, train_loop
from posttrain.train.optim import build_optimizer, build_scheduler
from posttrain.train.step import Runtime, optimizer_step
from posttrain.train.vision import start_vision_run, vision_loss_sum


def check_vision_sft(recipe: SFTRecipe) -> None:
    """What the image path does not support yet, named in one `ConfigError` before anything loads."""
    data, runtime, model = recipe.data, recipe.runtime, recipe.model
    unsupported = {
        "data.streaming (image chats are read whole)": data.streaming,
        "data.mix (mixing by metadata groups)": bool(data.mix.by or data.mix.weights or data.mix.samples_per_epoch),
        "data.dedup.near": data.dedup.near,
        "data.decontaminate.against": bool(data.decontaminate.against),
        "model.lora (LoRA on a vision-language model)": model.lora.enabled,
        "model.rope_scaling": model.rope_scaling is not None,
        "runtime.compile: true": runtime.compile is True,
        "runtime.activation_checkpointing": runtime.activation_checkpointing,
        "cluster.backend: ray": recipe.cluster.backend == "ray",
        "cluster.context_parallel > 1": recipe.cluster.context_parallel > 1,
    }
    named = [what for what, on in unsupported.items() if on]
    if named:
        raise ConfigError(f"SFT with a vision-language policy (model.vision) does not support yet: {'; '.join(named)} "
                          "(docs/multimodal.md): turn that off")


def vision_rows(processor: Any, samples: Sequence[VisionSample], max_length: int) -> list[dict[str, torch.Tensor]]:
    """Each chat's model inputs with assistant-only labels; a chat over `max_length` tokens is an error naming it."""
    rows = []
    for sample in samples:
        try:
            row = vision_inputs(processor, sample.messages, sample.images)
        except ModelError as error:
            raise DataError(f"{sample.metadata.origin}: {error}") from None
        length = int(row["input_ids"].shape[1])
        if length > max_length:
            raise DataError(f"{sample.metadata.origin}: {length} tokens with its images expanded, over "
                            f"data.max_length {max_length} (raise data.max_length, or shorten the chat)")
        rows.append(row)
    return rows


def run_vision_sft_recipe(recipe: SFTRecipe, *, resume: bool = False,
                          on_step: Callable[[int, dict[str, float]], None] | None = None) -> SFTResult:
    check_vision_sft(recipe)
    output_dir, runtime, data, model, processor = start_vision_run(recipe, read_vision_sft_data, "sft", resume)
    rows = vision_rows(processor, data.train, recipe.data.max_length)
    heldout_rows = vision_rows(processor, data.heldout, recipe.data.max_length)
    pad_id = processor.tokenizer.pad_token_id
    checkpoint = find_checkpoint(output_dir, "sft") if resume else None
    if checkpoint is not None:
        load_weights_from_checkpoint(model, checkpoint)

    config = recipe.train
    total_steps = config.max_steps or math.ceil(config.epochs * math.ceil(len(rows) / config.batch_size))
    optimizer = build_optimizer(model, recipe.optim)
    scheduler = build_scheduler(optimizer, recipe.optim, total_steps)
    state = restore_training(checkpoint, "sft", optimizer=optimizer, scheduler=scheduler) if checkpoint else None
    cursor = Cursor(**state["cursor"]) if state else Cursor()
    tracker = Tracker(output_dir, recipe.tracking, recipe=recipe.model_dump(mode="json"), stage="sft")
    if cursor.step == 0:
        tracker.log({"data/train": len(rows), "data/heldout": len(heldout_rows), "data/images": data.report["images"],
                     "data/duplicates_dropped": data.report["duplicates_dropped"]}, step=0)
    say(f"[sft] vision-language model ({type(model).__name__}): {count_parameters(model, trainable_only=True):,} "
        f"trainable parameters, {len(rows)} image chats, {total_steps} steps, {runtime.precision} on {runtime.device}")

    def epoch_items(epoch: int) -> list[dict[str, torch.Tensor]]:
        order = list(range(len(rows)))
        random.Random(recipe.runtime.seed * 1_000_003 + epoch).shuffle(order)  # a pure function: resume replays
        return [rows[i] for i in order]

    def step(batch: list[dict[str, torch.Tensor]]) -> StepFigures:
        return _step(model, batch, config.micro_batch_size or config.batch_size, pad_id, optimizer, scheduler,
                     runtime, recipe.optim.max_grad_norm)

    def heldout_loss() -> float:
        return evaluate_vision_loss(model, heldout_rows, pad_id, runtime, config.batch_size)

    last: dict[str, float] = {}  # the last evaluation's step and loss (not logged twice at the end)

    def evaluate() -> bool:
        loss = heldout_loss()
        tracker.log({"eval/heldout_loss": loss}, step=cursor.step)
        last.update(step=cursor.step, loss=loss)
        if cursor.best_score is None or -loss > cursor.best_score:
            cursor.best_score, cursor.best_step, cursor.evals_since_best = -loss, cursor.step, 0
        else:
            cursor.evals_since_best += 1
        say(f"[sft] step {cursor.step}: held-out loss {loss:.4f}")
        patience = config.early_stopping_patience
        return patience is not None and cursor.evals_since_best >= patience

    def save() -> None:
        save_training(output_dir, model, processor, optimizer=optimizer, scheduler=scheduler, cursor=cursor,
                      keep=config.keep_checkpoints)

    model.train()
    train_loss = train_loop("sft", config, cursor, total_steps, epoch_items=epoch_items, step=step,
                            scheduler=scheduler, tracker=tracker, save=save,
                            evaluate=evaluate if heldout_rows else None, on_step=on_step,
                            progress=lambda m: f"loss {m['train/loss']:.4f} {m['train/tokens_per_s']:,.0f} tok/s")
    final_heldout = last.get("loss") if last.get("step") == cursor.step else None
    if final_heldout is None and heldout_rows:
        final_heldout = heldout_loss()
        tracker.log({"eval/heldout_loss": final_heldout}, step=cursor.step)
    save()
    final_dir = save_model_dir(output_dir / "final", model, processor)
    tracker.close()
    stopped_by = cursor.stopped_by
    if stopped_by == "steps":
        stopped_by = "max_steps" if config.max_steps else "epochs"
    return SFTResult(output_dir=output_dir, final_dir=final_dir, steps=cursor.step, seconds=cursor.train_seconds,
                     tokens_per_s=cursor.tokens / max(cursor.train_seconds, 1e-9), train_loss=train_loss,
                     heldout_loss=final_heldout, data_report=data.report, stopped_by=stopped_by, tokens=cursor.tokens,
                     evaluation={"eval/heldout_loss": final_heldout} if final_heldout is not None else {})


def _step(model, rows: list[dict[str, torch.Tensor]], micro: int, pad_id: int, optimizer, scheduler,
          runtime: Runtime, max_grad_norm: float | None) -> StepFigures:
    """One optimizer step: micro-batches of `micro` chats, the loss divided by the whole step's assistant tokens."""
    trained_tokens = sum(int((row["labels"][:, 1:] != -100).sum()) for row in rows)
    loss_sum, input_tokens = 0.0, 0
    for start in range(0, len(rows), micro):
        chunk = rows[start : start + micro]
        with runtime.autocast():
            summed, _ = vision_loss_sum(model, chunk, pad_id)
        (summed / max(trained_tokens, 1)).backward()
        loss_sum += float(summed.detach())
        input_tokens += sum(int(row["input_ids"].shape[1]) for row in chunk)
    grad_norm = optimizer_step(model, optimizer, scheduler, max_grad_norm)
    return StepFigures(loss=loss_sum / max(trained_tokens, 1), grad_norm=grad_norm, weight=trained_tokens,
                       tokens=input_tokens, sums={"loss": loss_sum})


@torch.no_grad()
def evaluate_vision_loss(model, rows: Sequence[dict[str, torch.Tensor]], pad_id: int, runtime: Runtime,
                         batch_size: int) -> float:
    """Mean cross-entropy over the assistant tokens of `rows` (the held-out loss)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        with runtime.autocast():
            summed, n = vision_loss_sum(model, rows[start : start + batch_size], pad_id)
        total, count = total + float(summed), count + n
    model.train(was_training)
    return total / max(count, 1)
