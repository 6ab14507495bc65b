"""Data-parallel training over torch.distributed: a sharded (FSDP2) or replicated model, each rank's share of a
batch, and checkpoints in one process's format. No Ray here: a torchrun launch and the Ray trainer actors both use
it.

``cluster.data_parallel`` picks how the ranks hold the model (``auto``: ``replicate`` under `REPLICATE_BYTES` of
parameters, else ``fsdp``):

* ``fsdp``: each decoder layer (the model's ``_no_split_modules``), the decoder body and the output head are their
  own `fully_shard` units, then the root. The head is a unit of its own because the RL and SFT losses call the
  decoder and the head separately (`posttrain.train.forward.selected_logits`); a tied head shares one unit with
  the decoder. Parameters are gathered per unit for its forward and backward; only the last micro-batch of a
  step reduce-scatters (`_SyncLast`). Whole weights (for the engines, checkpoints) come to rank 0 in one gather
  per dtype (`_gather_rows`).
* ``replicate``: every rank holds the whole model and its optimizer state; after a step's backward passes one
  all-reduce sums the gradients (`reduce_gradients`), and every rank takes the same optimizer step. No
  collective runs during forward or backward, and rank 0 has the whole weights without any. Measured with
  tiny-3m on 2 cores, 2 gloo ranks of one thread, 2 micro-batches of 16 rows each: forward and backward 253 ms
  under ``fsdp``, and 157 ms for the same work on an unsharded model; the weights' gather took 8 ms.

Gradients are *summed* across ranks (plain SUM collectives, which gloo also has; for FSDP a divide factor of 1):
every rank divides its loss by the whole batch's normalizer, so the sum is one process's gradient.

Every rank sees the whole batch and takes the items ``rank, rank + world, ...`` of it (the batch is sorted by
length, so shares have similar lengths) in the same number of micro-batches on every rank; under ``fsdp`` a rank
whose share ran out takes a pass with no loss (`idle_backward`), because each forward and backward of a sharded
model is a collective all ranks must join.
"""

from __future__ import annotations

import copy
import math
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from posttrain.distributed.errors import DistributedError
from posttrain.train import load_optimizer_state, selected_logits, split_head


REPLICATE_BYTES = 1 << 30  # data_parallel "auto": replicate below this many parameter bytes, fsdp from it on


def data_parallel_mode(mode: str, model: torch.nn.Module) -> str:
    """``cluster.data_parallel`` resolved for `model`: "fsdp" or "replicate" (see the module docstring)."""
    if mode not in ("auto", "fsdp", "replicate"):
        raise DistributedError(f"cluster.data_parallel: expected auto, fsdp or replicate, got {mode!r}")
    if mode != "auto":
        return mode
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return "replicate" if size < REPLICATE_BYTES else "fsdp"


def _row_sharded(tensor: torch.Tensor) -> bool:
    """FSDP2's default placement: cut by rows over a one-dimensional mesh."""
    return (isinstance(tensor, DTensor) and tensor.ndim > 0 and tensor.device_mesh.ndim == 1
            and tuple(tensor.placements) == (Shard(0),))


class TorchDataParallel:
    """This process's rank in a data-parallel group; implements `train.parallel.DataParallel`, the seam
    of the SFT loop and the RL step."""

    def __init__(self, rank: int, world_size: int, device: torch.device, *, context_parallel: bool = False):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        # Context parallelism (`train.context_parallel`): every rank takes every row and a share of its tokens.
        self.context_parallel = context_parallel
        self.mesh = init_device_mesh(self.device.type, (world_size,))
        self._skeleton: torch.nn.Module | None = None  # rank 0: the model's shape on the meta device
        self._units: list[FSDPModule] = []
        self.mode = "fsdp"  # or "replicate" (`shard_model`)

    # ---- joining a group -------------------------------------------------------------------------------

    @classmethod
    def start(cls, rank: int, world_size: int, init_method: str, device: torch.device | str,
              timeout_s: float = 1800.0, *, context_parallel: bool = False) -> TorchDataParallel:
        """Join the group (gloo on CPU, NCCL on CUDA) at `init_method` (``tcp://host:port`` or ``env://``)."""
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                                    rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        return cls(rank, world_size, device, context_parallel=context_parallel)

    @classmethod
    def from_env(cls, device: torch.device | str, *, context_parallel: bool = False) -> TorchDataParallel | None:
        """The group a torchrun-style launcher describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT);
        None when there is none or it has one process."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return None
        device = torch.device(device)
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return cls.start(int(os.environ["RANK"]), world_size, "env://", device, context_parallel=context_parallel)

    def __enter__(self) -> TorchDataParallel:
        return self

    def __exit__(self, kind, *_: object) -> None:
        self.close(finished=kind is None)  # a rank that got through its work waits for the others

    def close(self, *, finished: bool = False) -> None:
        """Leave the group. `finished` (every rank got through its work): meet at a barrier first, so no rank
        tears down its side of the group while another still has traffic in flight (a rank torn down early was
        seen aborting at exit, "terminate called without an active exception", after a complete run)."""
        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()

    # ---- the model ---------------------------------------------------------------------------------------

    def shard_model(self, model: torch.nn.Module, mode: str = "auto") -> torch.nn.Module:
        """Rank 0's weights on every rank, then FSDP2 units or a replica (`mode`: see the module docstring)."""
        if hasattr(model, "peft_config"):
            raise DistributedError("sharded training of a LoRA model is not supported yet: train it in one "
                                   "process (cluster.num_trainer_workers: 1 / no torchrun) or without model.lora")
        mode = "replicate" if self.context_parallel else data_parallel_mode(mode, model)
        with torch.no_grad():
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)
        self.mode = mode
        if mode == "replicate":
            self._units = []
            return model
        if self.rank == 0:
            self._skeleton = copy.deepcopy(model).to("meta")
        layers = set(getattr(model, "_no_split_modules", None) or [])
        for module in list(model.modules()):
            if type(module).__name__ in layers:
                fully_shard(module, mesh=self.mesh)
        parts = split_head(model)
        if parts is not None:
            decoder, head = parts
            head_ids = {id(p) for p in head.parameters()}
            if any(id(p) in head_ids for p in decoder.parameters()):
                fully_shard([decoder, head], mesh=self.mesh)  # tied: one unit, unsharded for both calls
            else:
                fully_shard(decoder, mesh=self.mesh)
                fully_shard(head, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        self._units = [module for module in model.modules() if isinstance(module, FSDPModule)]
        for unit in self._units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        return model

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """After a step's backward passes: sum the replicas' gradients (one all-reduce per dtype); with FSDP
        the last backward did it already."""
        if self.mode != "replicate":
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for parameter in model.parameters():
            if parameter.requires_grad:
                if parameter.grad is None:  # this rank had no data for it: it adds zero
                    parameter.grad = torch.zeros_like(parameter)
                by_dtype.setdefault(parameter.grad.dtype, []).append(parameter.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Whole tensors by name on rank 0 (None elsewhere); every rank must call it (it all-gathers)."""
        if self.mode == "replicate":
            return ({name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()}
                    if self.rank == 0 else None)
        entries = model.state_dict()
        rows = {name: tensor for name, tensor in entries.items() if _row_sharded(tensor)}
        whole = self._gather_rows(rows)  # empty but on rank 0
        state = {}
        for name, tensor in entries.items():
            if name in rows:
                tensor = whole.get(name)
            elif isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()  # another placement: its own collective
            if self.rank == 0:
                state[name] = tensor.detach().to("cpu", copy=True)
        return state if self.rank == 0 else None

    def _gather_rows(self, tensors: dict[str, DTensor]) -> dict[str, torch.Tensor]:
        """Whole tensors on rank 0 (nothing elsewhere) from FSDP's row shards, in one gather per dtype.

        A tensor of N rows is cut like ``torch.chunk``: rank r holds rows [r * c, min(N, (r + 1) * c)) with
        c = ceil(N / world). Each rank packs its rows into a buffer of fixed slots (c rows per tensor, zero
        padded), rank 0 receives every rank's buffer and cuts the rows back out."""
        world, whole = self.world_size, {}
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, tensor in tensors.items():
            by_dtype.setdefault(tensor.dtype, []).append(name)
        for dtype, names in by_dtype.items():
            slots, offset = {}, 0
            for name in names:
                slots[name] = offset
                offset += math.ceil(tensors[name].shape[0] / world) * math.prod(tensors[name].shape[1:])
            flat = torch.zeros(offset, dtype=dtype, device=tensors[names[0]].to_local().device)
            for name, start in slots.items():
                shard = tensors[name].to_local().detach().reshape(-1)
                flat[start : start + shard.numel()] = shard
            received = [torch.empty_like(flat) for _ in range(world)] if self.rank == 0 else None
            dist.gather(flat, received, dst=0)
            if self.rank != 0:
                continue
            for name, start in slots.items():
                shape = tensors[name].shape
                chunk, row = math.ceil(shape[0] / world), math.prod(shape[1:])
                parts = [received[rank][start : start + max(0, min(shape[0], (rank + 1) * chunk) - rank * chunk) * row]
                         for rank in range(world)]
                whole[name] = torch.cat(parts).view(shape)
        return whole

    def load_full_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Copy whole tensors into the sharded model (each rank keeps its own shard; no communication)."""
        targets = dict(model.named_parameters())
        targets.update(dict(model.named_buffers()))
        with torch.no_grad():
            for name, value in state.items():
                target = targets.get(name)
                if target is None:
                    continue  # a tied weight saved under its other name
                if isinstance(target, DTensor):
                    value = distribute_tensor(value.to(target.device, target.dtype), target.device_mesh,
                                              target.placements, src_data_rank=None)
                    target.to_local().copy_(value.to_local())
                else:
                    target.copy_(value)

    def full_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """An unsharded model with the current weights on rank 0, for `save_pretrained` (None elsewhere)."""
        if self.mode == "replicate":
            return model if self.rank == 0 else None
        state = self.full_state_dict(model)
        if self.rank != 0:
            return None
        assert self._skeleton is not None, "shard_model() first"
        self._skeleton.load_state_dict(state, assign=True, strict=False)
        if hasattr(self._skeleton, "tie_weights"):
            self._skeleton.tie_weights()
        return self._skeleton

    # ---- the optimizer -------------------------------------------------------------------------------------

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """`optimizer.state_dict()` with whole tensors, as one process would save it, on rank 0."""
        saved = optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        for index, entry in saved["state"].items():
            whole = {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in entry.items()}
            if self.rank == 0:
                state[index] = {key: value.cpu() if torch.is_tensor(value) else value for key, value in whole.items()}
        return {"state": state, "param_groups": saved["param_groups"]} if self.rank == 0 else None

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a one-process optimizer state: each whole tensor is cut to this rank's shard of its parameter."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        converted: dict[int, dict[str, Any]] = {}
        for index, entry in state["state"].items():
            param = params[int(index)]
            converted[index] = {}
            for key, value in entry.items():
                if isinstance(param, DTensor) and torch.is_tensor(value) and tuple(value.shape) == tuple(param.shape):
                    value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                              src_data_rank=None)
                converted[index][key] = value
        load_optimizer_state(optimizer, {"state": converted, "param_groups": state["param_groups"]})

    # ---- a rank's share of a batch ---------------------------------------------------------------------

    def micro_batches(self, items: list[Any], micro_batch_size: int) -> list[list[Any]]:
        ranks = 1 if self.context_parallel else self.world_size  # context parallel: every rank takes every item
        share = items[self.rank % ranks :: ranks]
        count = math.ceil(math.ceil(len(items) / ranks) / micro_batch_size)
        return _SyncLast([share[i * micro_batch_size : (i + 1) * micro_batch_size] for i in range(count)],
                         self._units)

    def idle_backward(self, model: torch.nn.Module) -> None:
        if self.mode == "replicate":
            return  # no collective in forward or backward to keep in step
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        logits = selected_logits(model, ids, torch.ones((1, 1), dtype=torch.bool, device=self.device))
        (logits.sum() * 0.0).backward()

    def all_gather(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def barrier(self) -> None:
        dist.barrier()


class _SyncLast(list):
    """A rank's micro-batches. Iterated one by one ahead of each forward/backward (as `rl.update` does), it lets
    only the last backward reduce-scatter: the earlier ones accumulate unsharded gradients locally, which saves a
    collective per unit and micro-batch. Consumed all at once (as the SFT loop does), every backward syncs."""

    def __init__(self, chunks: list[list[Any]], units: list[FSDPModule]):
        super().__init__(chunks)
        self._units = units

    def __iter__(self):
        last = len(self) - 1
        for index, chunk in enumerate(list.__iter__(self)):
            for unit in self._units:
                unit.set_requires_gradient_sync(index == last, recurse=False)
            yield chunk
