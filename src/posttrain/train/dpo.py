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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from posttrain.config import DPORecipe, ModelConfig, dump_recipe
from posttrain.data import DataError
from posttrain.data.preference import (
    PreferenceData,
    TokenizedPair,
    collate_pairs,
    load_preference_data,
    pair_texts,
    tokenize_pairs,
)
from posttrain.models import (
    count_parameters,
    is_lora,
    latest_checkpoint,
    load_model,
    load_tokenizer,
    load_training_state,
    load_weights_from_checkpoint,
    reference_mode,
    restore_rng,
    save_checkpoint,
    save_model_dir,
)
from posttrain.tracking import Tracker, say
from posttrain.train.forward import check_forward_parity, selected_logits, target_logprobs
from posttrain.train.optim import build_optimizer, build_scheduler, load_optimizer_state
from posttrain.train.preference_losses import preference_loss
from posttrain.train.step import Runtime, optimizer_step, prepare_model, setup_runtime

REFERENCE_FILE = "reference_logprobs.pt"


@dataclass
class DPOResult:
    output_dir: Path
    final_dir: Path
    steps: int
    seconds: float  # training time (the reference pass is `reference_seconds`)
    reference_seconds: float
    pairs_per_s: float
    train_loss: float
    heldout_start: dict[str, float] = field(default_factory=dict)  # held-out metrics before the first step
    heldout: dict[str, float] = field(default_factory=dict)  # ... and at the end
    data_report: dict[str, Any] = field(default_factory=dict)


@dataclass
class PreparedPairs:
    train: list[TokenizedPair]
    heldout: list[TokenizedPair]
    report: dict[str, Any]


def run_dpo(
    recipe: DPORecipe,
    *,
    resume: bool = False,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> DPOResult:
    output_dir, runtime, tokenizer, pairs = start_run(recipe)
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

    state = resume_from_checkpoint("dpo", output_dir, model, optimizer, scheduler) if resume else None
    cursor = PairCursor(**state["cursor"]) if state else PairCursor()
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

    def batch_loss(batch, indices):
        return dpo_batch_loss(model, batch, None if train_reference is None else train_reference[indices], recipe,
                              runtime)

    train_loss = train_on_pairs(
        "dpo", recipe, model, pairs.train, tokenizer.pad_token_id, runtime.device, optimizer, scheduler, cursor,
        total_steps, tracker, batch_loss=batch_loss, evaluate=evaluate if pairs.heldout else None,
        save=lambda: _save(recipe, output_dir, model, tokenizer, optimizer, scheduler, cursor, heldout_start),
        on_step=on_step,
    )
    heldout = {}
    if pairs.heldout:
        heldout = evaluate()
        tracker.log({f"heldout/{k}": v for k, v in heldout.items()}, step=cursor.step)
    _save(recipe, output_dir, model, tokenizer, optimizer, scheduler, cursor, heldout_start)
    final_dir = save_model_dir(output_dir / "final", model, tokenizer, merge_lora=recipe.model.lora.merge_on_save)
    tracker.close()
    return DPOResult(
        output_dir=output_dir,
        final_dir=final_dir,
        steps=cursor.step,
        seconds=cursor.train_seconds,
        reference_seconds=reference_seconds,
        pairs_per_s=cursor.pairs / max(cursor.train_seconds, 1e-9),
        train_loss=train_loss,
        heldout_start=heldout_start,
        heldout=heldout,
        data_report=pairs.report,
    )


def start_run(recipe) -> tuple[Path, Runtime, Any, PreparedPairs]:
    """The run directory (with the resolved recipe), runtime, tokenizer and tokenized pairs of a DPO or reward
    model recipe. The built-in tokenizer (no model.path) is trained on the pairs' own text."""
    output_dir = Path(recipe.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "recipe.yaml").write_text(dump_recipe(recipe))
    runtime = setup_runtime(recipe.runtime)
    data = load_preference_data(recipe.data, rejects_dir=output_dir)
    corpus = pair_texts(data) if recipe.model.path is None and not recipe.model.tokenizer_path else None
    tokenizer = load_tokenizer(recipe.model, corpus=corpus)
    return output_dir, runtime, tokenizer, prepare_pairs(data, tokenizer, recipe)


def resume_from_checkpoint(stage: str, output_dir: Path, model, optimizer, scheduler) -> dict[str, Any] | None:
    """Load the newest checkpoint's weights, optimizer, schedule and RNG states; its training state, or None."""
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is None:
        say(f"[{stage}] --resume: no checkpoint in {output_dir}, starting fresh")
        return None
    state = load_training_state(checkpoint)
    load_weights_from_checkpoint(model, checkpoint)
    load_optimizer_state(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    restore_rng(state["rng"])
    say(f"[{stage}] resumed from {checkpoint} at step {state['cursor']['step']}")
    return state


def prepare_pairs(data: PreferenceData, tokenizer, recipe) -> PreparedPairs:
    """Tokenize the train and held-out pairs (shared by the DPO and reward-model recipes)."""
    config = recipe.data
    _, train, truncated = tokenize_pairs(data.train, tokenizer, config.max_length, on_invalid=config.on_invalid)
    _, heldout, heldout_truncated = tokenize_pairs(data.heldout, tokenizer, config.max_length,
                                                   on_invalid=config.on_invalid)
    if not train:
        raise DataError(f"data.train: no pair fits data.max_length={config.max_length}")
    # Under `on_invalid: skip`, pairs whose prompt leaves no room for a response are left out: counted here.
    too_long = len(data.train) + len(data.heldout) - len(train) - len(heldout)
    report = {**data.report, "pairs_kept": {"train": len(train), "heldout": len(heldout)},
              "truncated": truncated + heldout_truncated, "dropped_too_long": too_long}
    if too_long:
        say(f"[{recipe.stage}] {too_long} pairs left out: the prompt leaves no response token within "
                      f"data.max_length={config.max_length}")
    return PreparedPairs(train=train, heldout=heldout, report=report)


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


# ----------------------------------------------------------------------------------------------------
# Log-probs and the reference
# ----------------------------------------------------------------------------------------------------


def sequence_logprobs(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of the scored tokens of each row of a `collate_pairs` batch ([2B], fp32), and the
    number of scored tokens of each row. One forward per length group of the batch."""
    sums = None
    for group in batch["groups"]:
        with attention_kernel(model, group["input_ids"]):
            logits = selected_logits(model, group["input_ids"], group["select"])
        token_logprobs = target_logprobs(logits, group["targets"])
        if sums is None:
            sums = torch.zeros(batch["num_rows"], dtype=token_logprobs.dtype, device=token_logprobs.device)
        sums = sums.index_add(0, group["row_index"], token_logprobs)
    return sums, batch["token_counts"]


# Below this many tokens per row, plain attention (two matmuls and a softmax, Hugging Face's "eager") is the
# fastest on CPU for the right-padded rows of a pair batch: measured for 128 rows of 41 tokens, 4 heads, bf16,
# forward+backward, 31 ms eager vs 140 ms SDPA-math vs 178 ms SDPA-flash (whose backward is slow on CPU);
# and a whole tiny-3m DPO step runs ~15% faster than with the variable-length kernel, which has nothing to
# skip in unpacked rows. For long rows the fused kernels' O(T) memory wins.
EAGER_ATTENTION_MAX_TOKENS_CPU = 256
_SAME_AS_EAGER_ON_CAUSAL_ROWS = ("sdpa", "posttrain_varlen")


@contextlib.contextmanager
def attention_kernel(model: torch.nn.Module, input_ids: torch.Tensor):
    """Within the block, short CPU batches use plain attention; the model's setting is restored after.

    Only over implementations that compute the same thing for unpacked causal rows, and not with activation
    checkpointing: its recomputation in the backward pass runs outside this block and must see the same
    kernel as the forward.
    """
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if (input_ids.device.type != "cpu" or input_ids.shape[1] > EAGER_ATTENTION_MAX_TOKENS_CPU
            or current not in _SAME_AS_EAGER_ON_CAUSAL_ROWS or _activation_checkpointing(model)):
        yield
        return
    config._attn_implementation = "eager"
    try:
        yield
    finally:
        config._attn_implementation = current


def _activation_checkpointing(model: torch.nn.Module) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    flag = getattr(type(base), "is_activation_checkpointing", None)  # transformers >= 5.x; before: gradient_
    return bool(base.is_activation_checkpointing if flag is not None else getattr(base, "is_gradient_checkpointing",
                                                                                  False))


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
# Loss on a batch, the loop (shared with the reward model), evaluation
# ----------------------------------------------------------------------------------------------------


def dpo_batch_loss(model, batch: dict[str, Any], reference: torch.Tensor | None, recipe: DPORecipe,
                   runtime: Runtime) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-pair loss of a `collate_pairs` batch (with gradient) and its summed statistics.

    Statistics: loss, accuracy (implicit reward margin > 0), rewards and margin, summed log-probs of chosen
    and rejected, and preference (the policy itself gives chosen the higher log-prob, per token when the
    loss normalises by length).
    """
    with runtime.autocast():
        logprobs, counts = sequence_logprobs(model, batch)
    pairs = batch["num_pairs"]
    ref_chosen = ref_rejected = None
    if reference is not None:
        ref_chosen, ref_rejected = reference[:, 0].to(logprobs.device), reference[:, 1].to(logprobs.device)
    counts = counts.to(logprobs.dtype)
    result = preference_loss(recipe.dpo, logprobs[:pairs], logprobs[pairs:], ref_chosen, ref_rejected,
                             counts[:pairs], counts[pairs:])
    with torch.no_grad():
        margins = result.chosen_rewards - result.rejected_rewards
        scores = logprobs / counts.clamp(min=1) if recipe.dpo.normalizes_length else logprobs
        stats = sum_stats(loss=result.losses, accuracy=margins > 0, reward_chosen=result.chosen_rewards,
                      reward_rejected=result.rejected_rewards, reward_margin=margins,
                      logp_chosen=logprobs[:pairs], logp_rejected=logprobs[pairs:],
                      preference_accuracy=scores[:pairs] > scores[pairs:])
    return result.losses, stats


def sum_stats(**values: torch.Tensor) -> dict[str, float]:
    """Each tensor summed to a float (per-batch statistics the loop turns into per-pair means)."""
    return {key: float(value.detach().float().sum()) for key, value in values.items()}


@torch.no_grad()
def mean_stats(model, pairs: list[TokenizedPair], batch_size: int, pad_id: int, device,
               batch_stats: Callable[[dict[str, Any], slice], dict[str, float]]) -> dict[str, float]:
    """Per-pair means of the summed statistics `batch_stats(batch, positions)` returns, in eval mode."""
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    for start in range(0, len(pairs), batch_size):
        batch = collate_pairs(pairs[start : start + batch_size], pad_id, device)
        for key, value in batch_stats(batch, slice(start, start + batch["num_pairs"])).items():
            sums[key] = sums.get(key, 0.0) + value
    model.train(was_training)
    return {key: value / max(len(pairs), 1) for key, value in sums.items()}


def evaluate_pairs(model, pairs: list[TokenizedPair], reference: torch.Tensor | None, recipe: DPORecipe, tokenizer,
                   runtime: Runtime, batch_size: int) -> dict[str, float]:
    """Held-out loss, accuracy and preference accuracy (see `dpo_batch_loss`); accuracy is 0 before the first
    step, where every implicit reward margin is exactly 0."""

    def stats(batch, positions):
        part = None if reference is None else reference[positions]
        return dpo_batch_loss(model, batch, part, recipe, runtime)[1]

    return mean_stats(model, pairs, batch_size, tokenizer.pad_token_id, runtime.device, stats)


@dataclass
class PairCursor:
    """Where a run is: optimizer steps taken, the next pair of which epoch, time and pairs trained."""

    step: int = 0
    epoch: int = 0
    row: int = 0
    train_seconds: float = 0.0
    pairs: int = 0


def train_on_pairs(
    stage: str,
    recipe,
    model: torch.nn.Module,
    pairs: list[TokenizedPair],
    pad_id: int,
    device,
    optimizer,
    scheduler,
    cursor: PairCursor,
    total_steps: int,
    tracker: Tracker,
    *,
    batch_loss: Callable[[dict[str, Any], list[int]], tuple[torch.Tensor, dict[str, float]]],
    evaluate: Callable[[], dict[str, float]] | None,
    save: Callable[[], None],
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> float:
    """The optimisation loop over pairs shared by DPO and the reward model; returns the last step's loss.

    `batch_loss(batch, pair_indices)` gives per-pair losses (the optimizer batch's mean is minimised, also
    with gradient accumulation) and summed statistics, logged as per-pair means every `log_every` steps.
    """
    config = recipe.train
    micro = config.micro_batch_size or config.batch_size
    order = epoch_order(len(pairs), recipe.runtime.seed, cursor.epoch)
    sums: dict[str, float] = {}
    window_pairs, window_tokens, window_start, last_loss = 0, 0, time.perf_counter(), float("nan")
    tracker.start_progress(total_steps, done=cursor.step)
    model.train()
    while cursor.step < total_steps:
        if config.max_minutes is not None and cursor.train_seconds >= config.max_minutes * 60:
            say(f"[{stage}] time budget of {config.max_minutes} min reached at step {cursor.step}")
            break
        if cursor.row >= len(order):
            cursor.epoch, cursor.row = cursor.epoch + 1, 0
            order = epoch_order(len(pairs), recipe.runtime.seed, cursor.epoch)
        step_indices = order[cursor.row : cursor.row + config.batch_size]
        started = time.perf_counter()
        step_loss = 0.0
        for start in range(0, len(step_indices), micro):
            indices = step_indices[start : start + micro]
            batch = collate_pairs([pairs[i] for i in indices], pad_id, device)
            losses, stats = batch_loss(batch, indices)
            (losses.sum() / len(step_indices)).backward()
            step_loss += stats["loss"]
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value
            window_tokens += batch["num_tokens"]
        grad_norm = optimizer_step(model, optimizer, scheduler, recipe.optim.max_grad_norm)
        cursor.train_seconds += time.perf_counter() - started
        cursor.step += 1
        cursor.row += len(step_indices)
        cursor.pairs += len(step_indices)
        window_pairs += len(step_indices)
        last_loss = step_loss / len(step_indices)
        if on_step is not None:
            on_step(cursor.step, {"loss": last_loss, "grad_norm": grad_norm})
        if cursor.step % config.log_every == 0 or cursor.step == total_steps:
            elapsed = max(time.perf_counter() - window_start, 1e-9)
            metrics = {f"train/{key}": value / max(window_pairs, 1) for key, value in sums.items()}
            metrics.update({
                "train/grad_norm": grad_norm,
                "train/lr": scheduler.get_last_lr()[0],
                "train/pairs_per_s": window_pairs / elapsed,
                "train/tokens_per_s": window_tokens / elapsed,
                "train/epoch": cursor.epoch + cursor.row / max(len(order), 1),
            })
            tracker.log(metrics, step=cursor.step)
            tracker.advance(cursor.step, f"loss {metrics['train/loss']:.4f} acc {metrics['train/accuracy']:.2f} "
                            f"{metrics['train/pairs_per_s']:,.0f} pairs/s")
            sums, window_pairs, window_tokens, window_start = {}, 0, 0, time.perf_counter()
        if config.eval_every and cursor.step % config.eval_every == 0 and evaluate is not None:
            tracker.log({f"heldout/{key}": value for key, value in evaluate().items()}, step=cursor.step)
        if config.save_every and cursor.step % config.save_every == 0 and cursor.step < total_steps:
            save()
    return last_loss


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The pair order of `epoch`: a pure function of (seed, epoch), so a resume replays it exactly."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(count, generator=generator).tolist()


def _save(recipe, output_dir, model, tokenizer, optimizer, scheduler, cursor: PairCursor, heldout_start) -> None:
    save_checkpoint(
        output_dir,
        cursor.step,
        model,
        tokenizer,
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "cursor": vars(cursor).copy(),
         "heldout_start": heldout_start},
        keep=recipe.train.keep_checkpoints,
    )


def _flat(report: dict[str, Any]) -> dict[str, float]:
    """Numbers of a nested report as {"a/b": value} (for the metrics sinks)."""
    nested = {f"{k}/{inner}": v for k, value in report.items() if isinstance(value, dict)
              for inner, v in _flat(value).items()}
    return {**{k: v for k, v in report.items() if isinstance(v, (int, float))}, **nested}
