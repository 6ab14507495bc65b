"""What the pair recipes (DPO and the reward model) share: the run's pairs, their order, statistics, the loop.

    output_dir, runtime, tokenizer, pairs = start_pair_run(recipe, "dpo", resume)   # run dir, recipe.yaml, pairs
    ...
    train_loss = train_on_pairs(stage, recipe, model, pairs.train, ..., batch_loss=..., evaluate=..., save=...)

`batch_loss(batch, pair_indices)` is the recipe's own part: the per-pair losses of a `collate_pairs` batch (with
gradient) and summed statistics. The mean over the optimizer batch is minimised (also with gradient
accumulation over micro-batches), and the statistics are logged as per-pair means every `log_every` steps by
`train.loop.train_loop`, which owns the skeleton (budget, epochs, eval, save). The pair order of an epoch is a
pure function of (seed, epoch), so a resume replays it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from posttrain.data import (
    DataError,
    PreferenceData,
    TokenizedPair,
    collate_pairs,
    load_preference_data,
    pair_texts,
    tokenize_pairs,
)
from posttrain.models import load_tokenizer
from posttrain.tracking import say
from posttrain.train.checkpoint import open_run_dir
from posttrain.train.loop import Cursor, StepFigures, train_loop
from posttrain.train.preference_losses import sum_stats  # noqa: F401 (the reward model's, from here)
from posttrain.train.step import Runtime, optimizer_step, setup_runtime

# (collate_pairs batch, indices of its pairs) -> (per-pair losses with gradient, summed statistics incl. "loss")
# the pairs of a micro-batch -> its batch (with "num_pairs" and "num_tokens"); default `data.collate_pairs`
Collate = Callable[[list[Any]], dict[str, Any]]
BatchLoss = Callable[[dict[str, Any], list[int]], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class PreparedPairs:
    train: list[TokenizedPair]
    heldout: list[TokenizedPair]
    report: dict[str, Any]


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


def start_pair_run(recipe, stage: str, resume: bool) -> tuple[Path, Runtime, Any, PreparedPairs]:
    """The run directory (with the resolved recipe), runtime, tokenizer and tokenized pairs of a DPO or reward
    model recipe. The built-in tokenizer (no model.path) is trained on the pairs' own text."""
    output_dir = open_run_dir(recipe, stage, resume)
    runtime = setup_runtime(recipe.runtime)
    data = load_preference_data(recipe.data, rejects_dir=output_dir)
    corpus = pair_texts(data) if recipe.model.path is None and not recipe.model.tokenizer_path else None
    tokenizer = load_tokenizer(recipe.model, corpus=corpus)
    return output_dir, runtime, tokenizer, prepare_pairs(data, tokenizer, recipe)


def prepare_pairs(data: PreferenceData, tokenizer, recipe) -> PreparedPairs:
    """Tokenize the train and held-out pairs."""
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


@torch.no_grad()
def mean_stats(model, pairs: list[Any], batch_size: int, pad_id: int, device,
               batch_stats: Callable[[dict[str, Any], slice], dict[str, float]],
               collate: Collate | None = None) -> dict[str, float]:
    """Per-pair means of the summed statistics `batch_stats(batch, positions)` returns, in eval mode."""
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        batch = collate(chunk) if collate is not None else collate_pairs(chunk, pad_id, device)
        for key, value in batch_stats(batch, slice(start, start + batch["num_pairs"])).items():
            sums[key] = sums.get(key, 0.0) + value
    model.train(was_training)
    return {key: value / max(len(pairs), 1) for key, value in sums.items()}


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The pair order of `epoch`: a pure function of (seed, epoch), so a resume replays it exactly."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(count, generator=generator).tolist()


def train_on_pairs(
    stage: str,
    recipe,
    model: torch.nn.Module,
    pairs: list[Any],  # `TokenizedPair`s, or what `collate` takes
    pad_id: int,
    device,
    optimizer,
    scheduler,
    cursor: Cursor,
    total_steps: int,
    tracker,
    *,
    batch_loss: BatchLoss,
    evaluate: Callable[[], dict[str, float]] | None,
    save: Callable[[], None],
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    collate: Collate | None = None,
) -> float:
    """The optimisation loop over pairs; returns the last step's loss. `evaluate()`'s held-out figures are
    logged as ``heldout/*`` every `eval_every` steps."""
    micro = recipe.train.micro_batch_size or recipe.train.batch_size

    def step(indices: list[int]) -> StepFigures:
        sums: dict[str, float] = {}
        tokens = 0
        for start in range(0, len(indices), micro):
            chunk = indices[start : start + micro]
            items = [pairs[i] for i in chunk]
            batch = collate(items) if collate is not None else collate_pairs(items, pad_id, device)
            losses, stats = batch_loss(batch, chunk)
            (losses.sum() / len(indices)).backward()
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value
            tokens += batch["num_tokens"]
        grad_norm = optimizer_step(model, optimizer, scheduler, recipe.optim.max_grad_norm)
        return StepFigures(loss=sums["loss"] / len(indices), grad_norm=grad_norm, weight=len(indices),
                           tokens=tokens, sums=sums)

    def log_heldout() -> bool:
        tracker.log({f"heldout/{key}": value for key, value in evaluate().items()}, step=cursor.step)
        return False  # no early stopping for pairs

    model.train()
    return train_loop(
        stage, recipe.train, cursor, total_steps,
        epoch_items=lambda epoch: epoch_order(len(pairs), recipe.runtime.seed, epoch), step=step,
        scheduler=scheduler, tracker=tracker, save=save, evaluate=log_heldout if evaluate is not None else None,
        on_step=on_step, rate_name="pairs_per_s",
        progress=lambda m: (f"loss {m['train/loss']:.4f} acc {m['train/accuracy']:.2f} "
                            f"{m['train/pairs_per_s']:,.1f} pairs/s"),
    )
