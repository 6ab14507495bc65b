"""The DPO recipe, top to bottom: recipe -> model -> pairs -> reference log-probs (once) -> loop -> save.

    posttrain dpo recipe.yaml dpo.loss=ipo [--resume]

Losses (sigmoid DPO, conservative DPO, IPO, SimPO) are in `train.preference_losses`; docs/dpo.md has the
formulas. What makes it cheap:

- Reference log-probs are computed once, before the first step, for every train and held-out pair, and
  cached in the run directory (`reference_logprobs.pt`), so no reference model stays in memory and a
  resume reads them back instead of recomputing. With LoRA the reference is the base with the adapter
  switched off; otherwise it is the initial policy (or `dpo.reference_path`), computed before training.
- Chosen and rejected responses go through the model in one forward (a batch of 2B rows), right-padded
  with no attention mask (the causal kernel's fast path), and the output head runs only at response
  positions (`train.forward.selected_logits`), with fp32 logits for the log-softmax.
- bf16 autocast where the device runs it fast (`runtime.precision`), and on CPU plain attention for short
  rows, where PyTorch's fused attention kernels have a slow backward pass (`attention_kernel`).

Dropout is switched off: the policy's log-probs at step 0 must equal the reference's, or the loss starts
from noise. A run resumes exactly: the pair order is a pure function of (seed, epoch), and the checkpoint
holds the cursor, optimizer, schedule and RNG states.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from posttrain.config import DPORecipe, ModelConfig
from posttrain.data import TokenizedPair, collate_pairs
from posttrain.models import (
    attention_kernel,
    count_parameters,
    disable_dropout,
    is_lora,
    load_model,
    reference_mode,
    save_model_dir,
    wants_vision,
)
from posttrain.tracking import Tracker, say
from posttrain.train.dpo_vision import run_vision_dpo_recipe
from posttrain.train.checkpoint import find_checkpoint, restore_training, save_training
from posttrain.train.chunked import scored_token_stats
from posttrain.train.forward import check_forward_parity
from posttrain.train.loop import Cursor
from posttrain.train.optim import build_optimizer, build_scheduler
from posttrain.train.pairs import DPOResult, PreparedPairs, mean_stats, start_pair_run, train_on_pairs
from posttrain.train.preference_losses import scored_pair_loss
from posttrain.train.step import Runtime, prepare_model

REFERENCE_FILE = "reference_logprobs.pt"


def run_dpo(
    recipe: DPORecipe,
    *,
    resume: bool = False,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> DPOResult:
    if wants_vision(recipe.model):  # image prompts, a vision-language policy: train.dpo_vision
        return run_vision_dpo_recipe(recipe, resume=resume, on_step=on_step)
    output_dir, runtime, tokenizer, pairs = start_pair_run(recipe, "dpo", resume)
    model = load_model(recipe.model, tokenizer, runtime.device)
    model = prepare_model(model, recipe.model, recipe.runtime)
    disable_dropout(model)
    check_forward_parity(model, pairs.train, runtime.autocast_dtype, layout="padded", what="dpo")

    # Reference log-probs, before any checkpoint weights are loaded: the model is still the initial policy.
    started = time.perf_counter()
    reference = None
    if recipe.dpo.uses_reference:
        reference = cached_reference_logprobs(recipe, model, tokenizer, pairs, runtime, output_dir, resume)
    reference_seconds = time.perf_counter() - started

    micro = recipe.train.micro_batch_size or recipe.train.batch_size
    steps_per_epoch = max(1, math.ceil(len(pairs.train) / recipe.train.batch_size))
    total_steps = recipe.train.max_steps or math.ceil(recipe.train.epochs * steps_per_epoch)
    optimizer = build_optimizer(model, recipe.optim)
    scheduler = build_scheduler(optimizer, recipe.optim, total_steps)

    checkpoint = find_checkpoint(output_dir, "dpo") if resume else None
    state = None
    if checkpoint is not None:
        state = restore_training(checkpoint, "dpo", model=model, optimizer=optimizer, scheduler=scheduler)
    cursor = Cursor(**state["cursor"]) if state else Cursor()
    heldout_start = state.get("heldout_start", {}) if state else {}

    train_reference = _part(reference, "train")

    def evaluate() -> dict[str, float]:
        return evaluate_pairs(model, pairs.heldout, _part(reference, "heldout"), recipe, tokenizer, runtime, micro)

    tracker = Tracker(output_dir, recipe.tracking, recipe=recipe.model_dump(mode="json"), stage="dpo")
    if cursor.step == 0:
        tracker.log({f"data/{k}": v for k, v in _flat(pairs.report).items()}, step=0)
        if pairs.heldout:
            heldout_start = evaluate()
            tracker.log({f"heldout/{k}": v for k, v in heldout_start.items()}, step=0)
    say(
        f"[dpo] {count_parameters(model, trainable_only=True):,} trainable parameters, {len(pairs.train)} pairs, "
        f"{total_steps} steps, loss {recipe.dpo.loss}, {runtime.precision} on {runtime.device}"
    )

    def save() -> None:
        save_training(output_dir, model, tokenizer, optimizer=optimizer, scheduler=scheduler, cursor=cursor,
                      keep=recipe.train.keep_checkpoints, extra_state={"heldout_start": heldout_start})

    def batch_loss(batch, indices):
        return dpo_batch_loss(model, batch, None if train_reference is None else train_reference[indices], recipe,
                              runtime)

    train_loss = train_on_pairs(
        "dpo", recipe, model, pairs.train, tokenizer.pad_token_id, runtime.device, optimizer, scheduler, cursor,
        total_steps, tracker, batch_loss=batch_loss, evaluate=evaluate if pairs.heldout else None,
        save=save, on_step=on_step,
    )
    heldout = {}
    if pairs.heldout:
        heldout = evaluate()
        tracker.log({f"heldout/{k}": v for k, v in heldout.items()}, step=cursor.step)
    save()
    final_dir = save_model_dir(output_dir / "final", model, tokenizer, merge_lora=recipe.model.lora.merge_on_save)
    tracker.close()
    return DPOResult(
        output_dir=output_dir,
        final_dir=final_dir,
        steps=cursor.step,
        seconds=cursor.train_seconds,
        reference_seconds=reference_seconds,
        pairs_per_s=cursor.samples / max(cursor.train_seconds, 1e-9),
        train_loss=train_loss,
        heldout_start=heldout_start,
        heldout=heldout,
        data_report=pairs.report,
    )


# ----------------------------------------------------------------------------------------------------
# Log-probs and the reference
# ----------------------------------------------------------------------------------------------------


def sequence_logprobs(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of the scored tokens of each row of a `collate_pairs` batch ([2B], fp32), and the
    number of scored tokens of each row. One forward per length group of the batch."""
    sums = None
    for group in batch["groups"]:
        with attention_kernel(model, group["input_ids"]):
            token_logprobs = scored_token_stats(model, group["input_ids"], group["select"], group["targets"]).logprobs
        if sums is None:
            sums = torch.zeros(batch["num_rows"], dtype=token_logprobs.dtype, device=token_logprobs.device)
        sums = sums.index_add(0, group["row_index"], token_logprobs)
    return sums, batch["token_counts"]


@torch.no_grad()
def compute_reference_logprobs(
    model: torch.nn.Module, pairs: list[TokenizedPair], pad_id: int, runtime: Runtime, batch_size: int
) -> torch.Tensor:
    """[pairs, 2] summed log-probs (chosen, rejected) under the reference: for a LoRA model, adapter off."""
    was_training = model.training
    model.eval()
    out = torch.empty((len(pairs), 2), dtype=torch.float32)
    context = reference_mode(model) if is_lora(model) else contextlib.nullcontext()
    with context:
        for start in range(0, len(pairs), batch_size):
            batch = collate_pairs(pairs[start : start + batch_size], pad_id, runtime.device)
            with runtime.autocast():
                sums, _ = sequence_logprobs(model, batch)
            count = batch["num_pairs"]
            out[start : start + count, 0] = sums[:count].float().cpu()
            out[start : start + count, 1] = sums[count:].float().cpu()
    model.train(was_training)
    return out


def cached_reference_logprobs(
    recipe: DPORecipe, model, tokenizer, pairs: PreparedPairs, runtime: Runtime, output_dir: Path, resume: bool
) -> dict[str, torch.Tensor]:
    """{"train": [P, 2], "heldout": [H, 2]}: read from the run directory on resume, else computed and saved.

    The cache is keyed by a fingerprint of the reference's identity, the precision and every token id, so a
    resume with changed data or model recomputes instead of using stale numbers.
    """
    path = output_dir / REFERENCE_FILE
    fingerprint = _reference_fingerprint(recipe, runtime, pairs)
    if resume and path.is_file():
        cached = torch.load(path, map_location="cpu", weights_only=True)
        if cached.get("fingerprint") == fingerprint:
            say(f"[dpo] reference log-probs read from {path}")
            return {"train": cached["train"], "heldout": cached["heldout"]}
        say(f"[dpo] {path} is for other data or another reference: recomputing")
    batch_size = recipe.train.reference_batch_size or 2 * (recipe.train.micro_batch_size or recipe.train.batch_size)
    reference_model = model
    if recipe.dpo.reference_path is not None:
        config = ModelConfig(path=recipe.dpo.reference_path, dtype=recipe.model.dtype,
                             attn_implementation=recipe.model.attn_implementation)
        reference_model = load_model(config, tokenizer, runtime.device)
    pad_id = tokenizer.pad_token_id
    result = {
        "train": compute_reference_logprobs(reference_model, pairs.train, pad_id, runtime, batch_size),
        "heldout": compute_reference_logprobs(reference_model, pairs.heldout, pad_id, runtime, batch_size),
    }
    del reference_model
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save({"fingerprint": fingerprint, **result}, tmp)
    os.replace(tmp, path)
    return result


def _reference_fingerprint(recipe: DPORecipe, runtime: Runtime, pairs: PreparedPairs) -> str:
    model = recipe.model
    identity = {
        "reference": recipe.dpo.reference_path or model.path or f"built-in:{model.preset}:{model.seed}",
        "lora": model.lora.enabled,
        "dtype": model.dtype,
        "precision": runtime.precision,
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
    for part in (pairs.train, pairs.heldout):
        for pair in part:
            digest.update(json.dumps([pair.chosen_ids, pair.rejected_ids, pair.chosen_mask,
                                      pair.rejected_mask]).encode())
        digest.update(b"|")
    return digest.hexdigest()


def _part(reference: dict[str, torch.Tensor] | None, name: str) -> torch.Tensor | None:
    return None if reference is None else reference[name]


# ----------------------------------------------------------------------------------------------------
# Loss on a batch, evaluation
# ----------------------------------------------------------------------------------------------------


def dpo_batch_loss(model, batch: dict[str, Any], reference: torch.Tensor | None, recipe: DPORecipe,
                   runtime: Runtime) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-pair loss of a `collate_pairs` batch (with gradient) and its summed statistics
    (`train.preference_losses.scored_pair_loss`)."""
    with runtime.autocast():
        logprobs, counts = sequence_logprobs(model, batch)
    return scored_pair_loss(recipe.dpo, logprobs, counts, reference)


def evaluate_pairs(model, pairs: list[TokenizedPair], reference: torch.Tensor | None, recipe: DPORecipe, tokenizer,
                   runtime: Runtime, batch_size: int) -> dict[str, float]:
    """Held-out loss, accuracy and preference accuracy (see `dpo_batch_loss`); accuracy is 0 before the first
    step, where every implicit reward margin is exactly 0."""

    def stats(batch, positions):
        part = None if reference is None else reference[positions]
        return dpo_batch_loss(model, batch, part, recipe, runtime)[1]

    return mean_stats(model, pairs, batch_size, tokenizer.pad_token_id, runtime.device, stats)


def _flat(report: dict[str, Any]) -> dict[str, float]:
    """Numbers of a nested report as {"a/b": value} (for the metrics sinks)."""
    nested = {f"{k}/{inner}": v for k, value in report.items() if isinstance(value, dict)
              for inner, v in _flat(value).items()}
    return {**{k: v for k, v in report.items() if isinstance(v, (int, float))}, **nested}
