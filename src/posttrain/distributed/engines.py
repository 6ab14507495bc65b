"""Rollout engines as Ray actors: N `RolloutWorker`s, each with its own copy of the weights and thread budget,
behind one `EngineGroup` that the RL loop uses like a single engine.

A batch's tasks are split by index into N contiguous shares, one per worker; each worker rolls out its share
through the same code as one process (`rl.pipeline.engine_rollout`: its own `AsyncBatcher`, the environments,
the verifiers). Sampling seeds are per request (task member, seed), so a share samples the same tokens
whichever worker runs it and whatever else is batched with it: the batch does not depend on timing.

Weights go to every worker after each step (`update_weights`: one object in Ray's store, fetched by each
worker, timed); each worker acknowledges the version it now serves and the group checks them all. Every rollout
call also names the version and the weights it must be sampled with, so a worker that died and was restarted by
Ray (``cluster.max_restarts``) loads them before Ray retries the call: the retried share is the same share,
sampled again from the same weights with the same seeds — no trajectory is lost and none is counted twice.
"""

from __future__ import annotations

import os
import time
from typing import Any

from posttrain.config import RLRecipe
from posttrain.distributed.cluster import Placement, import_ray, worker_setup
from posttrain.distributed.errors import DistributedError
from posttrain.types import Completion, GenerationRequest, SamplingParams, Task, Trajectory

ROLE = "rollout workers"


class RolloutWorker:
    """One engine actor (see the module docstring)."""

    def __init__(self, recipe: RLRecipe, sandbox_workers: list[Any] | None = None):
        cluster = recipe.cluster
        worker_setup(cluster.rollout.threads, [*cluster.worker_imports, *recipe.imports])
        if sandbox_workers:
            from posttrain.distributed.sandbox import RaySandboxPool, install_default_pool

            install_default_pool(RaySandboxPool(sandbox_workers))
        from posttrain.models import load_model, load_tokenizer
        from posttrain.rl import engine_rollout
        from posttrain.train import setup_runtime

        device = "cuda" if cluster.rollout.num_gpus else "cpu"
        runtime = setup_runtime(recipe.runtime.model_copy(update={"device": device, "num_threads": None}))
        tokenizer = load_tokenizer(recipe.model)
        if recipe.rollout.engine == "vllm":
            from posttrain.rollout import VLLMEngine

            self.engine = VLLMEngine(recipe.model.path, tokenizer=tokenizer)
        else:
            from posttrain.rollout import HFEngine

            model = load_model(recipe.model, tokenizer, runtime.device)
            for parameter in model.parameters():
                parameter.requires_grad_(False)
            self.engine = HFEngine(model, tokenizer, autocast=runtime.autocast_dtype,
                                   max_batch_size=recipe.rollout.engine_batch_size,
                                   num_threads=cluster.rollout.threads)
        self._rollout = engine_rollout(self.engine, tokenizer, recipe)
        self._version: int | None = None  # None until the trainer's weights arrive (a restart starts here)

    def update_weights(self, state: list[Any], version: int) -> dict[str, Any]:
        """Load the weights in ``state[0]`` (an object ref, fetched here) as `version`; the acknowledgement."""
        import ray

        started = time.perf_counter()
        weights = ray.get(state[0])
        fetched = time.perf_counter() - started
        self.engine.update_weights(weights, version)
        self._version = version
        return {"version": version, "seconds": time.perf_counter() - started, "fetch_s": fetched, "pid": os.getpid()}

    def rollout(self, tasks: list[Task], sampling: SamplingParams, version: int, state: list[Any]
                ) -> tuple[list[Trajectory], dict[str, Any]]:
        self._ensure(version, state)
        return self._rollout(tasks, sampling), {"pid": os.getpid(), "version": self._version}

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams, version: int,
                 state: list[Any]) -> list[list[Completion]]:
        self._ensure(version, state)
        return self.engine.generate(requests, sampling)

    def _ensure(self, version: int, state: list[Any]) -> None:
        if self._version != version:  # restarted since the last push: take the weights the call names
            self.update_weights(state, version)


class EngineGroup:
    """N rollout workers behind the InferenceEngine contract, plus `rollout` for the batch producer."""

    def __init__(self, recipe: RLRecipe, placement: Placement, sandbox_workers: list[Any] | None = None,
                 name_prefix: str = "posttrain"):
        ray = import_ray()
        self._ray = ray
        self.recipe = recipe
        cluster = recipe.cluster
        self.group_size = recipe.rollout.sampling.group_size
        actor = ray.remote(RolloutWorker)
        self.workers = [
            actor.options(name=f"{name_prefix}-rollout-{index}", max_restarts=cluster.max_restarts,
                          max_task_retries=cluster.max_restarts,
                          **placement.options(ROLE, index, cluster.rollout)).remote(recipe, sandbox_workers)
            for index in range(cluster.num_rollout_workers)
        ]
        self._pids: list[int | None] = [None] * len(self.workers)
        self._state_ref: Any = None
        self._version: int | None = None
        self._calls = 0
        self.restarts = 0
        self.acknowledged: dict[int, int] = {}  # worker -> the version it last acknowledged
        self.last_sync: dict[str, float] = {}

    @property
    def policy_version(self) -> int:
        return -1 if self._version is None else self._version

    # ---- weights -------------------------------------------------------------------------------------------

    def update_weights(self, state: Any, version: int) -> float:
        """Every worker loads `state` (a state dict, or an object ref to one) as `version`; seconds taken."""
        started = time.perf_counter()
        ref = state if isinstance(state, self._ray.ObjectRef) else self._ray.put(state)
        self._state_ref, self._version = ref, version
        acks = self._get([worker.update_weights.remote([ref], version) for worker in self.workers], "weights")
        wrong = {index: ack["version"] for index, ack in enumerate(acks) if ack["version"] != version}
        if wrong:
            raise DistributedError(f"rollout workers acknowledged other versions than {version}: {wrong}")
        for index, ack in enumerate(acks):
            self._note(index, ack["pid"])
            self.acknowledged[index] = ack["version"]
        seconds = time.perf_counter() - started
        self.last_sync = {"sync_s": seconds, "worker_load_s": max(ack["seconds"] for ack in acks),
                          "worker_fetch_s": max(ack["fetch_s"] for ack in acks)}
        return seconds

    # ---- rollouts ------------------------------------------------------------------------------------------

    def rollout(self, tasks: list[Task], sampling: SamplingParams) -> list[Trajectory]:
        """Groups of episodes for `tasks`, in task order: the same as one engine would produce."""
        shares = _split(len(tasks), len(self.workers))
        calls = [(index, start, worker.rollout.remote(tasks[start:end], sampling, self._version, [self._state_ref]))
                 for index, (worker, (start, end)) in enumerate(zip(self.workers, shares)) if end > start]
        results = self._get([call for _, _, call in calls], "rollout")
        self._calls += 1
        trajectories: list[Trajectory] = []
        for (index, start, _), (share, info) in zip(calls, results):
            self._note(index, info["pid"])
            for position, trajectory in enumerate(share):
                # Group ids must be unique in the batch; each worker numbered its share from 0.
                task = tasks[start + position // self.group_size]
                trajectory.group_id = f"{task.id}#{self._calls}:{start + position // self.group_size}"
            trajectories += share
        return trajectories

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[list[Completion]]:
        """The requests split over the workers (the self-test so checks every worker's weights)."""
        shares = _split(len(requests), len(self.workers))
        calls = [worker.generate.remote(requests[start:end], sampling, self._version, [self._state_ref])
                 for worker, (start, end) in zip(self.workers, shares) if end > start]
        return [group for share in self._get(calls, "generate") for group in share]

    def metrics(self) -> dict[str, float]:
        out = {"cluster/rollout_restarts": float(self.restarts),
               "cluster/engines_at_version": float(sum(v == self._version for v in self.acknowledged.values()))}
        out.update({f"time/weights_{key}": value for key, value in self.last_sync.items()})
        return out

    def close(self) -> None:
        for worker in self.workers:
            try:
                self._ray.kill(worker, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    # ---- internals -------------------------------------------------------------------------------------------

    def _note(self, index: int, pid: int) -> None:
        if self._pids[index] is not None and self._pids[index] != pid:
            self.restarts += 1
        self._pids[index] = pid

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayActorError as error:
            raise DistributedError(
                f"a rollout worker died during {what} more than cluster.max_restarts="
                f"{self.recipe.cluster.max_restarts} times: {error}") from None


def _split(count: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous (start, end) shares of `count` items, sizes differing by at most one."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for index in range(parts):
        end = start + base + (1 if index < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
