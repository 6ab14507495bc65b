"""The RL recipe on a Ray cluster: the same loop as `posttrain.rl.trainer` on a Ray backend.

    posttrain rl recipe.yaml cluster.backend=ray [--resume]

Before anything starts, the cluster is checked for the CPUs/GPUs of every requested actor (`cluster.Placement`).
Then: sandbox workers (if any), ``num_rollout_workers`` engine actors (`engines.EngineGroup`) and
``num_trainer_workers`` FSDP ranks (`trainer.TrainerGroup`) start side by side; the driver (this process)
keeps the task scheduler, the pipeline, the guard, the logs and the checkpoints, as in one process.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

import torch

from posttrain.config import RLRecipe
from posttrain.distributed.cluster import Placement, Role, ray_session
from posttrain.distributed.engines import ROLE as ROLLOUT_ROLE
from posttrain.distributed.engines import EngineGroup
from posttrain.distributed.errors import DistributedError
from posttrain.distributed.sandbox import ROLE as SANDBOX_ROLE
from posttrain.distributed.sandbox import start_sandbox_workers
from posttrain.distributed.trainer import ROLE as TRAINER_ROLE
from posttrain.distributed.trainer import TrainerGroup, kill_all
from posttrain.rl import RLBackend, RLResult, run_rl as run_rl_local, run_rl_on
from posttrain.schedule import TaskSampler
from posttrain.train import Runtime


def launch_rl(
    recipe: RLRecipe,
    *,
    resume: bool = False,
    sampler: TaskSampler | None = None,
    on_step: Callable[[int, dict[str, float]], bool | None] | None = None,
) -> RLResult:
    """The RL recipe where the recipe says: `posttrain.rl.run_rl` in this process, or on Ray when
    ``cluster.backend`` is ``ray``."""
    if recipe.cluster.backend == "local":
        return run_rl_local(recipe, resume=resume, sampler=sampler, on_step=on_step)
    _check_supported(recipe)
    with ray_session(recipe.cluster):
        placement = Placement(recipe.cluster, roles(recipe))
        try:
            return run_rl_on(recipe, RayBackend(placement), resume=resume, sampler=sampler, on_step=on_step)
        finally:
            placement.close()


def roles(recipe: RLRecipe) -> list[Role]:
    cluster = recipe.cluster
    found = [Role(ROLLOUT_ROLE, cluster.num_rollout_workers, cluster.rollout),
             Role(TRAINER_ROLE, cluster.num_trainer_workers, cluster.trainer)]
    if cluster.num_sandbox_workers:
        found.append(Role(SANDBOX_ROLE, cluster.num_sandbox_workers, cluster.sandbox))
    return found


class RayBackend:
    """The `rl.backend.BackendFactory` of a Ray run: actors in their placement-group bundles."""

    def __init__(self, placement: Placement, name_prefix: str | None = None):
        self.placement = placement
        self.name_prefix = name_prefix or f"posttrain-{uuid.uuid4().hex[:8]}"

    def __call__(self, recipe: RLRecipe, runtime: Runtime, tokenizer: Any, model: torch.nn.Module) -> RLBackend:
        import ray

        sandboxes = start_sandbox_workers(recipe.cluster, self.placement, self.name_prefix)
        engines = EngineGroup(recipe, self.placement, sandboxes or None, self.name_prefix)
        for parameter in model.parameters():  # the driver's copy is a mirror: it is never trained
            parameter.requires_grad_(False)
        trainer = TrainerGroup(recipe, self.placement, model, self.name_prefix, extra_metrics=engines.metrics)
        try:
            trainer.start()
            trainer.ready()
        except BaseException:
            engines.close()
            kill_all(ray, sandboxes)
            raise

        def close() -> None:
            engines.close()
            kill_all(ray, sandboxes)

        return RLBackend(trainer, engines, engines.rollout, thread_setup=None, close=close)


def _check_supported(recipe: RLRecipe) -> None:
    if recipe.model.path is None:
        raise DistributedError("cluster.backend: ray needs model.path (a model directory or hub id): the workers "
                               "load the model themselves, and a fresh built-in model exists only in the driver; "
                               "run `posttrain sft` first, or train with cluster.backend: local")
    if recipe.model.lora.enabled:
        raise DistributedError("cluster.backend: ray does not support model.lora yet (the FSDP trainer shards "
                               "whole weights); train LoRA with cluster.backend: local")
    if recipe.rollout.engine == "vllm" and not recipe.cluster.rollout.num_gpus:
        raise DistributedError("rollout.engine: vllm runs on GPUs: set cluster.rollout.num_gpus (e.g. 1)")
