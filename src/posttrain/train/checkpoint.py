"""Checkpoint save and exact resume for a recipe's loop: weights, optimizer, LR schedule, RNG, data cursor, extras.

    checkpoint = find_checkpoint(output_dir, "sft") if resume else None
    if checkpoint: load_weights_from_checkpoint(model, checkpoint)      # before sharding: whole tensors
    ...build the optimizer and schedule...
    state = restore_training(checkpoint, "sft", optimizer=optimizer, scheduler=scheduler) if checkpoint else None
    cursor = Cursor(**state["cursor"]) if state else Cursor()
    ...
    save_training(output_dir, model, tokenizer, optimizer=optimizer, scheduler=scheduler, cursor=cursor,
                  keep=recipe.train.keep_checkpoints, extra_state={"heldout_start": ...})

The files are `models.save_checkpoint`'s (a Hugging Face directory plus `training_state.pt`, written under a
temporary name and renamed into place): the training state holds ``optimizer``, ``scheduler``, ``cursor`` (a
dict; its ``step`` names the checkpoint), ``rng`` and ``step``, and each key of `extra_state` beside them (an RM's
head, DPO's held-out figures at step 0, an RL run's scheduler or critic state). `write_extra(directory)` writes
more files into the checkpoint before it is renamed into place (an RL critic's weights). With a `DataParallel`
every rank calls `save_training` (the weights and optimizer state are gathered to rank 0, which alone writes).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import torch

from posttrain.models import latest_checkpoint, load_training_state, load_weights_from_checkpoint, restore_rng
from posttrain.models import save_checkpoint
from posttrain.tracking import say
from posttrain.train.parallel import LOCAL, DataParallel

RESERVED_KEYS = frozenset({"optimizer", "scheduler", "cursor", "rng", "step"})


def save_training(
    output_dir: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    cursor: Any,
    keep: int = 2,
    extra_state: dict[str, Any] | None = None,
    write_extra: Callable[[Path], None] | None = None,
    parallel: DataParallel = LOCAL,
) -> Path | None:
    """Write checkpoint `cursor.step` of the run in `output_dir`; its directory (None on ranks other than 0).

    `cursor` is a dataclass or a dict with a ``step``; it comes back as a dict from `restore_training`."""
    clash = RESERVED_KEYS & set(extra_state or {})
    if clash:
        raise ValueError(f"save_training: extra_state may not use the reserved keys {sorted(clash)}")
    optimizer_state = parallel.optimizer_state(optimizer)
    whole = parallel.full_model(model)
    if whole is None:  # not rank 0: it took part in gathering the state, rank 0 writes it
        return None
    cursor_state = dataclasses.asdict(cursor) if dataclasses.is_dataclass(cursor) else dict(cursor)
    state = {"optimizer": optimizer_state, "scheduler": None if scheduler is None else scheduler.state_dict(),
             "cursor": cursor_state, **(extra_state or {})}
    return save_checkpoint(output_dir, int(cursor_state["step"]), whole, tokenizer, state, keep=keep,
                           extra=write_extra)


def find_checkpoint(output_dir: Path, stage: str) -> Path | None:
    """The newest complete checkpoint of the run to resume, or None (said, and the run starts fresh)."""
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is None:
        say(f"[{stage}] --resume: no checkpoint in {output_dir}, starting fresh")
    return checkpoint


def restore_training(
    checkpoint: Path,
    stage: str,
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    model: torch.nn.Module | None = None,
    parallel: DataParallel = LOCAL,
) -> dict[str, Any]:
    """Restore what `save_training` wrote: the weights into `model` (in place, when given: pass None where they
    were loaded before sharding), the optimizer, the schedule and the RNG states; returns the training state
    (``cursor`` and the extras). Called after the optimizer exists, before the first step."""
    state = load_training_state(checkpoint)
    if model is not None:
        load_weights_from_checkpoint(model, checkpoint)
    parallel.load_optimizer_state(optimizer, state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    restore_rng(state["rng"])
    say(f"[{stage}] resumed from {checkpoint} at step {state['cursor']['step']}")
    return state
