"""The data-parallel seam of a training loop, and its one-process implementation.

A recipe's loop is written once against `DataParallel`: in one process it runs with `LocalParallel` (every
method the identity or nothing), sharded over processes with `posttrain.distributed.TorchDataParallel`. The
contract a loop follows, so that N ranks compute one process's step:

- every rank sees the whole step's items and backpropagates only `micro_batches(items, size)` of them (the same
  number of micro-batches on every rank; an empty one is an `idle_backward`);
- every rank divides its loss by the whole step's normalizer (`all_gather` the local counts and sum them), so the
  gradients `reduce_gradients` sums across ranks are one process's gradient;
- under context parallelism (``context_parallel`` True) every rank takes *every* item instead, and holds a
  zigzag share of each row's tokens (`train.context_parallel.shard_batch`): the counts and loss sums are shares,
  summed over the ranks as above;
- weights and optimizer state are gathered to rank 0 in one process's format (`full_model`, `optimizer_state`:
  every rank must call them), and rank 0 alone writes metrics and checkpoints (`rank == 0`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from posttrain.train.optim import load_optimizer_state


class DataParallel(Protocol):
    """What a loop needs of the group of processes it runs in."""

    rank: int
    world_size: int
    context_parallel: bool  # True: the ranks split every row's tokens, not the rows (the whole group)

    def shard_model(self, model: torch.nn.Module, mode: str = "auto") -> torch.nn.Module: ...

    def micro_batches(self, items: list[Any], micro_batch_size: int) -> list[list[Any]]:
        """This rank's micro-batches of a step: the same count on every rank, some possibly empty."""
        ...

    def idle_backward(self, model: torch.nn.Module) -> None:
        """A pass with no loss for an empty micro-batch, so the ranks' collectives stay in step."""
        ...

    def all_gather(self, value: Any) -> list[Any]:
        """`value` of every rank, in rank order."""
        ...

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """After the backward passes of an optimizer step: the ranks' gradients summed on every rank."""
        ...

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The optimizer state in one process's format on rank 0 (None elsewhere); every rank must call it."""
        ...

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None: ...

    def full_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """An unsharded model with the current weights on rank 0 (None elsewhere); every rank must call it."""
        ...


class LocalParallel:
    """One process: the whole step is this rank's, nothing to reduce or gather."""

    rank = 0
    world_size = 1
    context_parallel = False

    def shard_model(self, model: torch.nn.Module, mode: str = "auto") -> torch.nn.Module:
        return model

    def micro_batches(self, items: list[Any], micro_batch_size: int) -> list[list[Any]]:
        return [items[start : start + micro_batch_size] for start in range(0, len(items), micro_batch_size)]

    def idle_backward(self, model: torch.nn.Module) -> None:
        pass  # never called: every local micro-batch holds items

    def all_gather(self, value: Any) -> list[Any]:
        return [value]

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        pass

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        load_optimizer_state(optimizer, state)

    def full_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model


LOCAL = LocalParallel()
