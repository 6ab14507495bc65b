"""SFT sharded across processes: a torchrun-style launch, or a group of Ray actors, each rank running the same
`posttrain.train.sft.run_sft` with a `TorchDataParallel` (see that module for what a rank does).

    torchrun --nproc_per_node 2 -m posttrain sft recipe.yaml [--resume]
    posttrain sft recipe.yaml cluster.backend=ray cluster.num_trainer_workers=2

Rank 0 writes the checkpoints and the final model (the same files as a one-process run, so either kind of run
resumes the other's checkpoint); every rank reads the data itself, so the data and `output_dir` must be on a
filesystem every node sees.
"""

from __future__ import annotations

from typing import Callable

from posttrain.config import SFTRecipe
from posttrain.distributed.parallel import TorchDataParallel
from posttrain.models import resolve_device
from posttrain.train import SFTResult, run_sft as run_sft_local


def launch_sft(recipe: SFTRecipe, *, resume: bool = False,
            on_step: Callable[[int, dict[str, float]], None] | None = None) -> SFTResult | None:
    """One SFT run: sharded over a torchrun group when launched in one, over Ray actors with
    ``cluster.backend: ray``, else in this process. Returns rank 0's result (None on other torchrun ranks)."""
    parallel = TorchDataParallel.from_env(resolve_device(recipe.runtime))
    if parallel is not None:
        with parallel:
            result = run_sft_local(recipe, resume=resume, on_step=on_step, parallel=parallel)
        return result if parallel.rank == 0 else None
    if recipe.cluster.backend == "ray":
        from posttrain.distributed.cluster import ray_session
        from posttrain.distributed.trainer import run_sft_group

        with ray_session(recipe.cluster):
            return run_sft_group(recipe, resume=resume, on_step=on_step)
    return run_sft_local(recipe, resume=resume, on_step=on_step)
