"""The DPO recipe on image prompts, top to bottom: recipe -> image pairs -> processor and model -> reference
log-probs (once) -> loop -> save.

    posttrain dpo recipe.yaml model.vision=true         # the built-in tiny VLM; or model.path=<a VLM directory>

`run_dpo` hands a recipe here when its policy is a vision-language model (`models.wants_vision`). A pair is a shared
prompt holding the image(s) and two replies (`data.read_vision_pair_data`); each reply is scored with the prompt and
its images, by the policy and by the reference, as the processor renders the whole chat (`train.vision.
pair_sequences`: the chat's ids split where the reply's labels start, so the reply's tokens are those SFT trains).
Every loss of the text recipe applies (`dpo.loss`: sigmoid, cdpo, ipo, simpo; `train.preference_losses`), with its
statistics; the loop, logging, checkpoints and exact resume are the pair recipes' (`train.pairs.train_on_pairs`).

Reference log-probs are computed once, before the first step, by the initial policy (or ``dpo.reference_path``, a
VLM directory) with dropout off, and kept in memory (a resume computes them again from the initial weights, which it
loads before the checkpoint's). A pair longer than ``data.max_length`` with its image tokens expanded is an error
naming its record. Refused up front like SFT's image path: LoRA, rope scaling, compile, activation checkpointing.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import torch

from posttrain.config import ConfigError, DPORecipe
from posttrain.data import DataError, VisionPairSample, read_vision_pair_data
from posttrain.models import (
    count_parameters,
    disable_dropout,
    load_vision_model,
    load_weights_from_checkpoint,
    save_model_dir,
)
from posttrain.tracking import Tracker, say
from posttrain.train.checkpoint import find_checkpoint, restore_training, save_training
from posttrain.train.loop import Cursor
from posttrain.train.optim import build_optimizer, build_scheduler
from posttrain.train.pairs import DPOResult, mean_stats, train_on_pairs
from posttrain.train.preference_losses import scored_pair_loss
from posttrain.train.step import Runtime
from posttrain.train.vision import ImageSequence, completion_logprobs, pair_sequences, start_vision_run

PairSequences = tuple[ImageSequence, ImageSequence]  # (chosen, rejected)


def check_vision_dpo(recipe: DPORecipe) -> None:
    unsupported = {
        "model.lora (LoRA on a vision-language model)": recipe.model.lora.enabled,
        "model.rope_scaling": recipe.model.rope_scaling is not None,
        "runtime.compile: true": recipe.runtime.compile is True,
        "runtime.activation_checkpointing": recipe.runtime.activation_checkpointing,
    }
    named = [what for what, on in unsupported.items() if on]
    if named:
        raise ConfigError(f"DPO with a vision-language policy (model.vision) does not support yet: {'; '.join(named)} "
                          "(docs/multimodal.md): turn that off")


def vision_pair_sequences(processor: Any, pairs: Sequence[VisionPairSample], max_length: int) -> list[PairSequences]:
    out = []
    for pair in pairs:
        chosen, rejected = pair_sequences(processor, pair)
        longest = max(len(s.prompt_ids) + len(s.completion_ids) for s in (chosen, rejected))
        if longest > max_length:
            raise DataError(f"{pair.metadata.origin}: {longest} tokens with its images expanded, over "
                            f"data.max_length {max_length} (raise data.max_length, or shorten the pair)")
        out.append((chosen, rejected))
    return out


def _collate(pairs: Sequence[PairSequences]) -> dict[str, Any]:
    """A micro-batch of pairs: the chosen replies first, then the rejected (the order `scored_pair_loss` reads)."""
    sequences = [p[0] for p in pairs] + [p[1] for p in pairs]
    return {"sequences": sequences, "num_pairs": len(pairs),
            "num_tokens": sum(len(s.prompt_ids) + len(s.completion_ids) for s in sequences)}


def _scores(model, batch: dict[str, Any], pad_id: int, runtime: Runtime) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of each reply of `batch` and its number of tokens ([2P] each)."""
    with runtime.autocast():
        logprobs = completion_logprobs(model, batch["sequences"], pad_id=pad_id)
    return (torch.stack([lp.sum() for lp in logprobs]),
            torch.tensor([len(lp) for lp in logprobs], device=logprobs[0].device))


@torch.no_grad()
def vision_reference_logprobs(model, pairs: Sequence[PairSequences], pad_id: int, runtime: Runtime,
                              batch_size: int) -> torch.Tensor:
    """[pairs, 2] summed log-probs (chosen, rejected) under `model` in eval mode."""
    was_training = model.training
    model.eval()
    out = torch.empty((len(pairs), 2), dtype=torch.float32)
    for start in range(0, len(pairs), batch_size):
        batch = _collate(pairs[start : start + batch_size])
        sums = _scores(model, batch, pad_id, runtime)[0].float().cpu()
        count = batch["num_pairs"]
        out[start : start + count, 0], out[start : start + count, 1] = sums[:count], sums[count:]
    model.train(was_training)
    return out


def run_vision_dpo_recipe(recipe: DPORecipe, *, resume: bool = False,
                          on_step: Callable[[int, dict[str, float]], None] | None = None) -> DPOResult:
    check_vision_dpo(recipe)
    output_dir, runtime, data, model, processor = start_vision_run(recipe, read_vision_pair_data, "dpo", resume)
    disable_dropout(model)  # the policy's log-probs at step 0 must equal the reference's
    train = vision_pair_sequences(processor, data.train, recipe.data.max_length)
    heldout = vision_pair_sequences(processor, data.heldout, recipe.data.max_length)
    pad_id = processor.tokenizer.pad_token_id
    micro = recipe.train.micro_batch_size or recipe.train.batch_size

    # Reference log-probs, before any checkpoint weights are loaded: the model is still the initial policy.
    started = time.perf_counter()
    reference = {"train": None, "heldout": None}
    if recipe.dpo.uses_reference:
        reference_model = model
        if recipe.dpo.reference_path is not None:
            reference_model = load_vision_model(recipe.dpo.reference_path, dtype=recipe.model.dtype,
                                                device=runtime.device)[0]
        size = recipe.train.reference_batch_size or 2 * micro
        reference = {name: vision_reference_logprobs(reference_model, part, pad_id, runtime, size)
                     for name, part in (("train", train), ("heldout", heldout))}
        del reference_model
    reference_seconds = time.perf_counter() - started

    total_steps = recipe.train.max_steps or math.ceil(recipe.train.epochs * max(1, math.ceil(
        len(train) / recipe.train.batch_size)))
    optimizer = build_optimizer(model, recipe.optim)
    scheduler = build_scheduler(optimizer, recipe.optim, total_steps)
    checkpoint = find_checkpoint(output_dir, "dpo") if resume else None
    state = None
    if checkpoint is not None:
        load_weights_from_checkpoint(model, checkpoint)
        state = restore_training(checkpoint, "dpo", optimizer=optimizer, scheduler=scheduler)
    cursor = Cursor(**state["cursor"]) if state else Cursor()
    heldout_start = state.get("heldout_start", {}) if state else {}

    def batch_loss(batch: dict[str, Any], indices: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs, counts = _scores(model, batch, pad_id, runtime)
        part = None if reference["train"] is None else reference["train"][indices]
        return scored_pair_loss(recipe.dpo, logprobs, counts, part)

    def evaluate() -> dict[str, float]:
        def stats(batch: dict[str, Any], positions: slice) -> dict[str, float]:
            part = None if reference["heldout"] is None else reference["heldout"][positions]
            return scored_pair_loss(recipe.dpo, *_scores(model, batch, pad_id, runtime), part)[1]

        return mean_stats(model, heldout, micro, pad_id, runtime.device, stats, collate=_collate)

    tracker = Tracker(output_dir, recipe.tracking, recipe=recipe.model_dump(mode="json"), stage="dpo")
    if cursor.step == 0:
        tracker.log({"data/pairs_train": len(train), "data/pairs_heldout": len(heldout),
                     "data/images": data.report["images"]}, step=0)
        if heldout:
            heldout_start = evaluate()
            tracker.log({f"heldout/{k}": v for k, v in heldout_start.items()}, step=0)
    say(f"[dpo] vision-language model ({type(model).__name__}): {count_parameters(model, trainable_only=True):,} "
        f"trainable parameters, {len(train)} image pairs, {total_steps} steps, loss {recipe.dpo.loss}, "
        f"{runtime.precision} on {runtime.device}")

    def save() -> None:
        save_training(output_dir, model, processor, optimizer=optimizer, scheduler=scheduler, cursor=cursor,
                      keep=recipe.train.keep_checkpoints, extra_state={"heldout_start": heldout_start})

    train_loss = train_on_pairs("dpo", recipe, model, train, pad_id, runtime.device, optimizer, scheduler, cursor,
                                total_steps, tracker, batch_loss=batch_loss,
                                evaluate=evaluate if heldout else None, save=save, on_step=on_step,
                                collate=_collate)
    heldout_end = evaluate() if heldout else {}
    if heldout_end:
        tracker.log({f"heldout/{k}": v for k, v in heldout_end.items()}, step=cursor.step)
    save()
    final_dir = save_model_dir(output_dir / "final", model, processor)
    tracker.close()
    return DPOResult(output_dir=output_dir, final_dir=final_dir, steps=cursor.step, seconds=cursor.train_seconds,
                     reference_seconds=reference_seconds, pairs_per_s=cursor.samples / max(cursor.train_seconds, 1e-9),
                     train_loss=train_loss, heldout_start=heldout_start, heldout=heldout_end, data_report=data.report)
