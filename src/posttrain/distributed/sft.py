"""SFT across processes: a torchrun-style launch, a group of Ray actors, or the context-parallel ranks
`posttrain sft` starts itself; each rank runs the same `posttrain.train.sft.run_sft` with a `TorchDataParallel`
(see that module for what a rank does).

    torchrun --nproc_per_node 2 -m posttrain sft recipe.yaml [--resume]
    posttrain sft recipe.yaml cluster.backend=ray cluster.num_trainer_workers=2
    posttrain sft recipe.yaml cluster.context_parallel=2        # 2 ranks on this machine split every row

Rank 0 writes the checkpoints and the final model (the same files as a one-process run, so either kind of run
resumes the other's checkpoint); every rank reads the data itself, so the data and `output_dir` must be on a
filesystem every node sees.

Context parallelism (``cluster.context_parallel: R``): R ranks take every row of every step, each a zigzag share
of its tokens (`posttrain.train.context_parallel`), and sum their gradients. Not under torchrun, this process
starts the R ranks itself (``torch.multiprocessing``, spawned: gloo on CPU, one GPU each with NCCL) and returns
rank 0's result; under torchrun the group must have exactly R processes (context and data parallelism together
are not supported).
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from pathlib import Path
from typing import Callable

import torch

from posttrain.config import SFTRecipe
from posttrain.distributed.errors import DistributedError
from posttrain.distributed.parallel import TorchDataParallel
from posttrain.models import resolve_device
from posttrain.train import SFTResult, run_sft as run_sft_local


def launch_sft(recipe: SFTRecipe, *, resume: bool = False,
            on_step: Callable[[int, dict[str, float]], None] | None = None) -> SFTResult | None:
    """One SFT run: sharded over a torchrun group when launched in one, over Ray actors with
    ``cluster.backend: ray``, over `cluster.context_parallel` ranks started here, else in this process. Returns
    rank 0's result (None on other torchrun ranks)."""
    context = recipe.cluster.context_parallel
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if context > 1 and launched > 1 and launched != context:
        raise DistributedError(
            f"cluster.context_parallel is {context} but torchrun started {launched} processes: launch exactly "
            f"{context} (context and data parallelism together are not supported), or drop torchrun and let "
            "`posttrain sft` start the ranks")
    parallel = TorchDataParallel.from_env(resolve_device(recipe.runtime), context_parallel=context > 1)
    if parallel is not None:
        with parallel:
            result = run_sft_local(recipe, resume=resume, on_step=on_step, parallel=parallel)
        return result if parallel.rank == 0 else None
    if context > 1:
        return _run_context_parallel(recipe, resume=resume, on_step=on_step)
    if recipe.cluster.backend == "ray":
        from posttrain.distributed.cluster import ray_session
        from posttrain.distributed.trainer import run_sft_group

        with ray_session(recipe.cluster):
            return run_sft_group(recipe, resume=resume, on_step=on_step)
    return run_sft_local(recipe, resume=resume, on_step=on_step)


def _run_context_parallel(recipe: SFTRecipe, *, resume: bool, on_step: Callable | None) -> SFTResult:
    """Start `cluster.context_parallel` ranks on this machine, wait for them, and return rank 0's result."""
    ranks = recipe.cluster.context_parallel
    if on_step is not None:
        raise DistributedError("launch_sft: an on_step callback runs in this process, and the context-parallel "
                               "ranks are other processes: drop the callback or cluster.context_parallel")
    device = resolve_device(recipe.runtime)
    if device.type == "cuda" and torch.cuda.device_count() < ranks:
        raise DistributedError(f"cluster.context_parallel: {ranks} ranks need {ranks} GPUs (one each); "
                               f"this machine has {torch.cuda.device_count()}")
    with socket.socket() as probe:  # a free port for the group's rendezvous (rank 0 listens on it)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="posttrain-context-parallel-") as scratch:
        result_path = Path(scratch) / "result.pkl"
        try:
            torch.multiprocessing.spawn(_context_parallel_rank, args=(ranks, port, recipe, resume, str(result_path)),
                                        nprocs=ranks, join=True)
        except torch.multiprocessing.ProcessRaisedException as error:
            last = [line for line in str(error).strip().splitlines() if line.strip()][-1]
            raise DistributedError(f"a context-parallel rank failed: {last}") from error
        except torch.multiprocessing.ProcessExitedException as error:
            raise DistributedError(f"a context-parallel rank died: {error}") from error
        return pickle.loads(result_path.read_bytes())


def _context_parallel_rank(rank: int, ranks: int, port: int, recipe: SFTRecipe, resume: bool,
                           result_path: str) -> None:
    """One context-parallel rank (a spawned process): join the group, run the recipe, rank 0 keeps the result."""
    from posttrain.distributed.cluster import worker_setup

    # Each rank gets its share of the cores unless the recipe says how many threads to use.
    worker_setup(recipe.runtime.num_threads or max(1, (os.cpu_count() or 1) // ranks), recipe.imports)
    device = resolve_device(recipe.runtime)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
    parallel = TorchDataParallel.start(rank, ranks, f"tcp://127.0.0.1:{port}", device, context_parallel=True)
    with parallel:
        result = run_sft_local(recipe, resume=resume, parallel=parallel)
    if rank == 0:
        Path(result_path).write_bytes(pickle.dumps(result))
