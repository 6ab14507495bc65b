"""The reward-model recipe (Bradley–Terry), top to bottom: recipe -> model -> pairs -> loop -> save.

    posttrain rm recipe.yaml [--resume]

Model: the causal LM's decoder plus a scalar head, r(x, y) = w . h_last, where h_last is the final hidden state
at the last token of the rendered conversation (prompt + response, which ends with the template's end-of-turn
token): `models.ScalarRewardModel`. Loss: Bradley–Terry, -log sigmoid(r_chosen - r_rejected), plus an optional
centring term `rm.center_coef * (r_chosen + r_rejected)^2` (Eisenstein et al., 2023) that pins the reward's free
offset near zero. Held-out pairwise accuracy is P(r_chosen > r_rejected) on held-out pairs.

Saved as a plain `AutoModelForSequenceClassification` with one label (the run's `final/`; `models.reward` has
the format), which `models.load_reward_model` — or transformers itself — loads. Checkpoints hold the causal LM
trunk (with its LoRA adapter, for an exact resume) and the head in the training state (``reward_head``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from posttrain.config import RMRecipe
from posttrain.data import TokenizedPair, collate_pairs
from posttrain.models import ScalarRewardModel, count_parameters, disable_dropout, load_model, save_reward_model
from posttrain.tracking import Tracker, say
from posttrain.train.checkpoint import find_checkpoint, restore_training, save_training
from posttrain.train.loop import Cursor
from posttrain.train.forward import check_forward_parity
from posttrain.train.optim import build_optimizer, build_scheduler
from posttrain.train.pairs import mean_stats, start_pair_run, sum_stats, train_on_pairs
from posttrain.train.preference_losses import bradley_terry_loss
from posttrain.train.step import Runtime, prepare_model


@dataclass
class RMResult:
    output_dir: Path
    final_dir: Path
    steps: int
    seconds: float
    pairs_per_s: float
    train_loss: float
    heldout_start: dict[str, float] = field(default_factory=dict)
    heldout: dict[str, float] = field(default_factory=dict)
    data_report: dict[str, Any] = field(default_factory=dict)


def run_rm(
    recipe: RMRecipe, *, resume: bool = False, on_step: Callable[[int, dict[str, float]], None] | None = None
) -> RMResult:
    output_dir, runtime, tokenizer, pairs = start_pair_run(recipe, "rm", resume)
    causal_lm = prepare_model(load_model(recipe.model, tokenizer, runtime.device), recipe.model, recipe.runtime)
    disable_dropout(causal_lm)
    check_forward_parity(causal_lm, pairs.train, runtime.autocast_dtype, layout="padded", what="rm")
    model = ScalarRewardModel.from_causal_lm(causal_lm)

    micro = recipe.train.micro_batch_size or recipe.train.batch_size
    steps_per_epoch = max(1, math.ceil(len(pairs.train) / recipe.train.batch_size))
    total_steps = recipe.train.max_steps or math.ceil(recipe.train.epochs * steps_per_epoch)
    optimizer = build_optimizer(model, recipe.optim)
    scheduler = build_scheduler(optimizer, recipe.optim, total_steps)

    # The checkpoint's HF directory holds the trunk (as a causal LM); the head travels in the training state.
    checkpoint = find_checkpoint(output_dir, "rm") if resume else None
    state = None
    if checkpoint is not None:
        state = restore_training(checkpoint, "rm", model=causal_lm, optimizer=optimizer, scheduler=scheduler)
        model.head.load_state_dict(state["reward_head"])
    cursor = Cursor(**state["cursor"]) if state else Cursor()
    heldout_start = state.get("heldout_start", {}) if state else {}

    pad_id = tokenizer.pad_token_id

    def evaluate() -> dict[str, float]:
        return evaluate_reward_model(model, pairs.heldout, pad_id, runtime, micro)

    def save() -> None:
        save_training(output_dir, causal_lm, tokenizer, optimizer=optimizer, scheduler=scheduler, cursor=cursor,
                      keep=recipe.train.keep_checkpoints,
                      extra_state={"heldout_start": heldout_start, "reward_head": model.head.state_dict()})

    tracker = Tracker(output_dir, recipe.tracking, recipe=recipe.model_dump(mode="json"), stage="rm")
    if cursor.step == 0 and pairs.heldout:
        heldout_start = evaluate()
        tracker.log({f"heldout/{k}": v for k, v in heldout_start.items()}, step=0)
    say(f"[rm] {count_parameters(model, trainable_only=True):,} trainable parameters, "
        f"{len(pairs.train)} pairs, {total_steps} steps, {runtime.precision} on {runtime.device}")
    train_loss = train_on_pairs(
        "rm", recipe, model, pairs.train, pad_id, runtime.device, optimizer, scheduler, cursor, total_steps, tracker,
        batch_loss=lambda batch, _: reward_losses(model, batch, runtime, recipe.rm.center_coef),
        evaluate=evaluate if pairs.heldout else None, save=save, on_step=on_step,
    )
    heldout = {}
    if pairs.heldout:
        heldout = evaluate()
        tracker.log({f"heldout/{k}": v for k, v in heldout.items()}, step=cursor.step)
    save()
    stats_pairs = (pairs.train + pairs.heldout)[: recipe.rm.stats_pairs]
    mean, std = reward_statistics(model, stats_pairs, pad_id, runtime, micro)
    final_dir = save_reward_model(output_dir / "final", model, tokenizer, mean=mean, std=std)
    tracker.close()
    return RMResult(output_dir=output_dir, final_dir=final_dir, steps=cursor.step, seconds=cursor.train_seconds,
                    pairs_per_s=cursor.samples / max(cursor.train_seconds, 1e-9), train_loss=train_loss,
                    heldout_start=heldout_start, heldout=heldout, data_report=pairs.report)


def batch_rewards(model: ScalarRewardModel, batch: dict[str, Any]) -> torch.Tensor:
    """[2B] rewards of a `collate_pairs` batch, in row order (one forward per length group)."""
    outputs = [model(group["input_ids"], group["last_index"]) for group in batch["groups"]]
    rows = torch.cat([group["rows"] for group in batch["groups"]])
    return torch.cat(outputs)[torch.argsort(rows)]


def reward_losses(model: ScalarRewardModel, batch: dict[str, Any], runtime: Runtime, center_coef: float):
    """Per-pair Bradley–Terry loss (+ centring) of a `collate_pairs` batch, and summed statistics."""
    with runtime.autocast():
        rewards = batch_rewards(model, batch)
    pairs = batch["num_pairs"]
    chosen, rejected = rewards[:pairs], rewards[pairs:]
    losses = bradley_terry_loss(chosen, rejected)
    if center_coef:
        losses = losses + center_coef * (chosen + rejected) ** 2
    stats = sum_stats(loss=losses, accuracy=chosen > rejected, reward_chosen=chosen, reward_rejected=rejected,
                      reward_margin=chosen - rejected)
    return losses, stats


def evaluate_reward_model(model, pairs: list[TokenizedPair], pad_id: int, runtime: Runtime,
                          batch_size: int) -> dict[str, float]:
    """Held-out loss and pairwise accuracy (ties count as wrong: a constant reward scores 0)."""
    return mean_stats(model, pairs, batch_size, pad_id, runtime.device,
                      lambda batch, _: reward_losses(model, batch, runtime, 0.0)[1])


@torch.no_grad()
def reward_statistics(model, pairs: list[TokenizedPair], pad_id: int, runtime: Runtime,
                      batch_size: int) -> tuple[float, float]:
    """Mean and standard deviation of the rewards of both responses of `pairs` (saved for normalising)."""
    model.eval()
    rewards = []
    for start in range(0, len(pairs), batch_size):
        batch = collate_pairs(pairs[start : start + batch_size], pad_id, runtime.device)
        with runtime.autocast():
            rewards.append(batch_rewards(model, batch).float().cpu())
    if not rewards:
        return 0.0, 1.0
    values = torch.cat(rewards)
    return float(values.mean()), float(values.std()) if values.numel() > 1 else 1.0
