"""The trainer as a group of Ray actors: N ranks, one FSDP-sharded copy of the policy between them.

RL: each `TrainerRank` holds a `rl.update.LocalPolicy` over its sharded model with a `TorchDataParallel` as its
`DataParallel`, so a step is the same `rl_update` as in one process (see `rl.update` and `distributed.parallel`).
After the step the ranks gather the whole weights; rank 0 returns them into Ray's object store, from where the
engines fetch them (the driver passes the reference on without fetching). `TrainerGroup` is the driver's side,
a `rl.update.PolicyTrainer`: it keeps an unsharded mirror of the policy, refreshed only when something reads it
(checkpoints, evaluation), and writes the checkpoints itself, in one process's format (the optimizer state is
gathered to whole tensors), so a run resumes on either backend.

A rank that dies stops the run: the others would wait forever in their next collective, so the group raises
`TrainerRankError` at once and kills them; `--resume` then continues from the last checkpoint exactly.

SFT: `run_sft_group` starts N ranks that each run `train.sft.run_sft` with a `TorchDataParallel`.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any, Callable

import torch

from posttrain.config import ClusterConfig, RLRecipe, SFTRecipe
from posttrain.distributed.cluster import Placement, Role, import_ray, worker_setup
from posttrain.distributed.errors import TrainerRankError
from posttrain.models import load_weights_from_checkpoint
from posttrain.types import Trajectory

ROLE = "trainer ranks"


class TrainerRank:
    """One rank (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, cluster: ClusterConfig, imports: list[str] | None = None):
        worker_setup(cluster.trainer.threads, [*cluster.worker_imports, *(imports or [])])
        self.rank, self.world_size, self.cluster = rank, world_size, cluster
        self.device = torch.device("cuda" if cluster.trainer.num_gpus else "cpu")
        self.parallel = None
        self.policy = None

    def init_method(self) -> str:
        """Where the group meets: this node's address and a free port (asked of rank 0)."""
        import ray

        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def _join(self, init_method: str) -> None:
        from posttrain.distributed.parallel import TorchDataParallel

        self.parallel = TorchDataParallel.start(self.rank, self.world_size, init_method, self.device)

    # ---- RL ----------------------------------------------------------------------------------------------

    def setup_rl(self, recipe: RLRecipe, init_method: str) -> None:
        from posttrain.models import load_model, load_tokenizer
        from posttrain.rl import LocalPolicy, make_reference
        from posttrain.train import prepare_model, setup_runtime

        self._join(init_method)
        runtime = setup_runtime(recipe.runtime.model_copy(update={"device": self.device.type, "num_threads": None}))
        tokenizer = load_tokenizer(recipe.model)
        model = prepare_model(load_model(recipe.model, tokenizer, self.device), recipe.model, recipe.runtime)
        reference = make_reference(model, recipe, runtime) if recipe.algorithm.kl_coef > 0 else None
        model = self.parallel.shard_model(model, recipe.cluster.data_parallel)
        self.policy = LocalPolicy(model, tokenizer, runtime, recipe, parallel=self.parallel,
                                  replay_scale=1.0 / self.world_size, reference=reference)

    def update(self, batch: tuple[list[Trajectory], list[float], list | None]):
        """The step (trajectories, advantages, replay) on this rank's share; then (rank 0's metrics, rank 0's
        whole weights)."""
        started = time.perf_counter()
        metrics = self.policy.update(*batch)
        gathering = time.perf_counter()
        state = self.parallel.full_state_dict(self.policy.model)
        metrics["time/rank_update_s"] = gathering - started  # the rest of the driver's train_s is Ray's share
        metrics["time/weights_gather_s"] = time.perf_counter() - gathering
        return (metrics if self.rank == 0 else None), state

    def optimizer_state(self) -> dict[str, Any] | None:
        optimization = self.policy.optimization
        optimizer = self.parallel.optimizer_state(optimization.optimizer)
        return {"optimizer": optimizer, "scheduler": optimization.scheduler.state_dict()} if self.rank == 0 else None

    def load(self, weights: list[Any], state: dict[str, Any]) -> None:
        import ray

        self.parallel.load_full_state_dict(self.policy.model, ray.get(weights[0]))
        self.parallel.load_optimizer_state(self.policy.optimization.optimizer, state["optimizer"])
        self.policy.optimization.scheduler.load_state_dict(state["scheduler"])

    def set_lr_scale(self, scale: float) -> None:
        self.policy.set_lr_scale(scale)

    # ---- SFT ---------------------------------------------------------------------------------------------

    def run_sft(self, recipe: SFTRecipe, init_method: str, resume: bool, on_step):
        from posttrain.train import run_sft

        self._join(init_method)
        recipe = recipe.model_copy(update={"runtime": recipe.runtime.model_copy(
            update={"device": self.device.type, "num_threads": None})})
        with self.parallel:
            result = run_sft(recipe, resume=resume, on_step=on_step, parallel=self.parallel)
        return result if self.rank == 0 else None


def start_ranks(cluster: ClusterConfig, placement: Placement, name_prefix: str = "posttrain",
                imports: list[str] | None = None) -> list[Any]:
    ray = import_ray()
    actor = ray.remote(TrainerRank)
    # No restarts: a restarted rank could not rejoin its group mid-step; the run stops and resumes instead.
    return [actor.options(name=f"{name_prefix}-trainer-{rank}", max_restarts=0,
                          **placement.options(ROLE, rank, cluster.trainer)).remote(rank, cluster.num_trainer_workers,
                                                                                   cluster, imports)
            for rank in range(cluster.num_trainer_workers)]


def wait_all(ray, refs: list[Any], what: str) -> list[Any]:
    """All results, or `TrainerRankError` as soon as one rank is gone (the others may be stuck waiting for it)."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done)
        except ray.exceptions.RayActorError as error:
            raise TrainerRankError(f"a trainer rank died during {what}: the run stopped. Run it again with "
                                   f"--resume to continue exactly from the last checkpoint. ({error})") from None
    return ray.get(refs)


class TrainerGroup:
    """The driver's side of the RL trainer ranks: a `rl.update.PolicyTrainer` (see the module docstring)."""

    def __init__(self, recipe: RLRecipe, placement: Placement, mirror: torch.nn.Module,
                 name_prefix: str = "posttrain", extra_metrics: Callable[[], dict[str, float]] | None = None):
        self._ray = import_ray()
        self.recipe, self.model = recipe, mirror
        self.ranks = start_ranks(recipe.cluster, placement, name_prefix, recipe.imports)
        self._extra_metrics = extra_metrics
        self._state_ref: Any = None  # rank 0's whole weights after the last step (not fetched here)
        self._mirror_stale = False
        self._setup: list[Any] | None = None
        self._steps = 0

    def start(self) -> None:
        """Form the process group and load the model on every rank (started early, waited for by `ready`)."""
        init_method = self._get([self.ranks[0].init_method.remote()], "start-up")[0]
        self._setup = [rank.setup_rl.remote(self.recipe, init_method) for rank in self.ranks]

    def ready(self) -> None:
        if self._setup is not None:
            self._get(self._setup, "start-up")
            self._setup = None

    def update(self, trajectories: list[Trajectory], advantages: list[float], replay: list | None
               ) -> dict[str, float]:
        self.ready()
        batch = self._ray.put((trajectories, advantages, replay))
        calls = [rank.update.options(num_returns=2).remote(batch) for rank in self.ranks]
        self._steps += 1
        metrics = self._get([metrics for metrics, _ in calls], f"step {self._steps}")[0]
        self._state_ref, self._mirror_stale = calls[0][1], True
        if self._extra_metrics is not None:
            metrics.update(self._extra_metrics())
        return metrics

    def weights(self, copy: bool = False) -> Any:
        if self._state_ref is None:
            from posttrain.rl import engine_state

            return engine_state(self.model)
        return self._state_ref

    def full_model(self) -> torch.nn.Module:
        if self._mirror_stale:
            self.model.load_state_dict(self._ray.get(self._state_ref))
            self._mirror_stale = False
        return self.model

    def state_dict(self) -> dict[str, Any]:
        self.ready()
        return self._get([rank.optimizer_state.remote() for rank in self.ranks], "checkpoint")[0]

    def load_checkpoint(self, checkpoint: Path, state: dict[str, Any]) -> None:
        from posttrain.rl import engine_state

        self.ready()
        load_weights_from_checkpoint(self.model, checkpoint)
        weights = self._ray.put(engine_state(self.model))
        trainer_state = {"optimizer": state["optimizer"], "scheduler": state["scheduler"]}
        self._get([rank.load.remote([weights], trainer_state) for rank in self.ranks], "resume")
        self._state_ref, self._mirror_stale = weights, False

    def set_lr_scale(self, scale: float) -> None:
        self.ready()
        self._get([rank.set_lr_scale.remote(scale) for rank in self.ranks], "lr change")

    def close(self) -> None:
        kill_all(self._ray, self.ranks)

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        try:
            return wait_all(self._ray, refs, what)
        except TrainerRankError:
            self.close()
            raise


def kill_all(ray, actors: list[Any]) -> None:
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def run_sft_group(recipe: SFTRecipe, *, resume: bool = False, on_step=None, name_prefix: str = "posttrain"):
    """SFT on ``cluster.num_trainer_workers`` Ray actors (placement checked first); rank 0's `SFTResult`."""
    ray = import_ray()
    cluster = recipe.cluster
    placement = Placement(cluster, [Role(ROLE, cluster.num_trainer_workers, cluster.trainer)])
    ranks = start_ranks(cluster, placement, name_prefix, recipe.imports)
    try:
        init_method = wait_all(ray, [ranks[0].init_method.remote()], "start-up")[0]
        results = wait_all(ray, [rank.run_sft.remote(recipe, init_method, resume, on_step) for rank in ranks], "sft")
        return results[0]
    finally:
        kill_all(ray, ranks)
        placement.close()
