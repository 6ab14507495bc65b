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
RL, whose optimizer lives behind its policy trainer (perhaps a Ray group), writes through `write_checkpoint`
and restores with `restore_training(..., restore=...)`: the four recipes share one format and one order.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import torch

from posttrain.config import dump_recipe
from posttrain.models import latest_checkpoint, load_training_state, load_weights_from_checkpoint, restore_rng
from posttrain.models import save_checkpoint
from posttrain.tracking import METRICS_FILE, TENSORBOARD_DIR, say
from posttrain.types import PosttrainError
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
    optimizer_state = parallel.optimizer_state(optimizer)
    whole = parallel.full_model(model)
    if whole is None:  # not rank 0: it took part in gathering the state, rank 0 writes it
        return None
    trainer_state = {"optimizer": optimizer_state, "scheduler": None if scheduler is None else scheduler.state_dict()}
    return write_checkpoint(output_dir, whole, tokenizer, trainer_state=trainer_state, cursor=cursor, keep=keep,
                            extra_state=extra_state, write_extra=write_extra)


def write_checkpoint(
    output_dir: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    trainer_state: dict[str, Any],
    cursor: Any,
    keep: int = 2,
    extra_state: dict[str, Any] | None = None,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """`save_training` for a loop whose optimizer lives elsewhere (RL's policy trainer, perhaps a Ray group):
    `model` is the whole model and `trainer_state` its ``{"optimizer": ..., "scheduler": ...}``."""
    clash = RESERVED_KEYS & set(extra_state or {})
    if clash:
        raise ValueError(f"save_training: extra_state may not use the reserved keys {sorted(clash)}")
    cursor_state = dataclasses.asdict(cursor) if dataclasses.is_dataclass(cursor) else dict(cursor)
    state = {"optimizer": trainer_state["optimizer"], "scheduler": trainer_state.get("scheduler"),
             "cursor": cursor_state, **(extra_state or {})}
    return save_checkpoint(output_dir, int(cursor_state["step"]), model, tokenizer, state, keep=keep,
                           extra=write_extra)


def find_checkpoint(output_dir: Path, stage: str) -> Path | None:
    """The newest complete checkpoint of the run to resume, or None (said, and the run starts fresh)."""
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is None:
        say(f"[{stage}] --resume: no checkpoint in {output_dir}, starting fresh")
    return checkpoint


def open_run_dir(recipe: Any, stage: str, resume: bool, *, write_recipe: bool = True,
                 logs: tuple[str, ...] = ()) -> Path:
    """The recipe's `output_dir`, made, with the resolved recipe saved in it (`write_recipe`: False on ranks that
    do not write). A fresh run (not `resume`) is refused, before anything is written, where an earlier run's model
    or checkpoints are; the metrics (and the stage's own append-only `logs`) of an earlier run that ended before
    its first checkpoint are moved aside."""
    output_dir = Path(recipe.output_dir)
    if not resume:
        _require_no_earlier_run(output_dir, stage)
    output_dir.mkdir(parents=True, exist_ok=True)
    if write_recipe:
        if not resume:
            _set_aside_earlier_logs(output_dir, stage, (METRICS_FILE, TENSORBOARD_DIR, *logs))
        (output_dir / "recipe.yaml").write_text(dump_recipe(recipe))
    return output_dir


class EarlierRunError(PosttrainError):
    """A fresh run was pointed at a directory that holds an earlier run's model or checkpoints."""


def _require_no_earlier_run(output_dir: Path, stage: str) -> None:
    checkpoint = latest_checkpoint(output_dir)
    final = output_dir / "final"
    if checkpoint is None and not final.is_dir():
        return
    held = f"checkpoints up to {checkpoint.name}" if checkpoint is not None else "its final model"
    raise EarlierRunError(f"{stage}: {output_dir} holds an earlier run ({held}); a fresh run there would replace "
                          "it, so nothing was started: --resume continues it, or set output_dir to a new "
                          "directory (or remove this one)")


def _set_aside_earlier_logs(output_dir: Path, stage: str, names: tuple[str, ...]) -> None:
    """A run that died before its first checkpoint leaves its logs: a fresh run appended to them (its curves
    showed the dead run's steps past the new run's last: read_metrics keeps the last record per step; RL's
    episodes mixed two runs). They move, whole, to the first free `earlier-<n>/` in `output_dir`; nothing is
    deleted."""
    held = [output_dir / name for name in names if (output_dir / name).exists()]
    if not held:
        return
    number = 1
    while (output_dir / f"earlier-{number}").exists():
        number += 1
    aside = output_dir / f"earlier-{number}"
    aside.mkdir()
    for path in held:
        path.rename(aside / path.name)
    say(f"[{stage}] {output_dir} held the logs of an earlier run that saved no checkpoint: moved to {aside}")


def restore_training(
    checkpoint: Path,
    stage: str,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    model: torch.nn.Module | None = None,
    parallel: DataParallel = LOCAL,
    restore: Callable[[dict[str, Any]], None] | None = None,
    announce: bool = True,
) -> dict[str, Any]:
    """Restore what `save_training` wrote: the weights into `model` (in place, when given: pass None where they
    were loaded before sharding), the optimizer, the schedule, then `restore(state)` (what else the recipe keeps:
    RL's policy trainer, sampler and guard) and last the RNG states; returns the training state (``cursor`` and
    the extras). Called after the optimizer exists, before the first step."""
    state = load_training_state(checkpoint)
    if model is not None:
        load_weights_from_checkpoint(model, checkpoint)
    if optimizer is not None:
        parallel.load_optimizer_state(optimizer, state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore is not None:
        restore(state)
    restore_rng(state["rng"])
    if announce:
        say(f"[{stage}] resumed from {checkpoint} at step {state['cursor']['step']}")
    return state
