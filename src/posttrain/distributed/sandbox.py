"""Sandbox execution spread over Ray workers.

A `SandboxWorker` actor owns an ordinary `posttrain.sandbox.SandboxPool` (bubblewrap jails, ``slots`` at a
time). `RaySandboxPool` is the client side: it has the pool methods the `Sandbox` API calls (`execute`,
`aexecute`, `submit`), so ``Sandbox(pool=RaySandboxPool(workers))`` runs its programs on the workers, and
`install_default_pool` makes it the process's default pool, the one verifiers and tools use when given no
sandbox. Runs go to the workers in turn.

A worker that dies is restarted by Ray (``cluster.max_restarts``) and the runs it had in flight are retried
there: a run is a fresh jail every time, so running it again is safe.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import Future
from typing import Any

from posttrain.config import ClusterConfig
from posttrain.distributed.cluster import Placement, import_ray, worker_setup
from posttrain.sandbox import PoolStats, RunRequest, RunResult, SandboxPool

ROLE = "sandbox workers"


class SandboxWorker:
    def __init__(self, slots: int, backend: str, threads: int):
        worker_setup(threads, [])
        self.pool = SandboxPool(slots, backend=backend)

    def execute(self, request: RunRequest) -> RunResult:
        return self.pool.execute(request)

    def capabilities(self) -> dict[str, Any]:
        return self.pool.capabilities()

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def pid(self) -> int:
        return os.getpid()


def start_sandbox_workers(cluster: ClusterConfig, placement: Placement, name_prefix: str = "posttrain") -> list[Any]:
    """The run's sandbox worker actors (their handles go to every rollout worker)."""
    ray = import_ray()
    actor = ray.remote(SandboxWorker)
    return [
        actor.options(name=f"{name_prefix}-sandbox-{index}", max_restarts=cluster.max_restarts,
                      max_task_retries=cluster.max_restarts, max_concurrency=cluster.sandbox_slots,
                      **placement.options(ROLE, index, cluster.sandbox)
                      ).remote(cluster.sandbox_slots, cluster.sandbox_backend, cluster.sandbox.threads)
        for index in range(cluster.num_sandbox_workers)
    ]


class RaySandboxPool:
    """The `SandboxPool` methods `Sandbox` calls, executed on sandbox worker actors (see the module docstring)."""

    def __init__(self, workers: list[Any]):
        if not workers:
            raise ValueError("RaySandboxPool needs at least one sandbox worker")
        self._ray = import_ray()
        self.workers = list(workers)
        self.size = len(self.workers)
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._retries = 2 * self.size  # of a run that came back as infra_error

    def _next(self) -> Any:
        with self._lock:
            return self.workers[next(self._turn) % self.size]

    def execute(self, request: RunRequest) -> RunResult:
        result = self._ray.get(self._next().execute.remote(request))
        for _ in range(self._retries):
            if not result.is_infra_error:
                break
            result = self._ray.get(self._next().execute.remote(request))
        return result

    async def aexecute(self, request: RunRequest) -> RunResult:
        # A worker that dies mid-run can hand back its jails' infra_error before Ray restarts it: such a run
        # is not the program's doing, so it runs again (on the next worker), as Ray re-runs a lost task.
        result = await self._next().execute.remote(request)
        for _ in range(self._retries):
            if not result.is_infra_error:
                break
            result = await self._next().execute.remote(request)
        return result

    def submit(self, request: RunRequest) -> Future:
        return self._next().execute.remote(request).future()

    def capabilities(self) -> dict[str, Any]:
        return self._ray.get(self.workers[0].capabilities.remote())

    def stats(self) -> PoolStats:
        total = PoolStats()
        for stats in self._ray.get([worker.stats.remote() for worker in self.workers]):
            for key, value in vars(stats).items():
                setattr(total, key, getattr(total, key) + value)
        return total

    def close(self) -> None:
        pass  # the workers belong to the run that started them

    def __enter__(self) -> RaySandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def install_default_pool(pool: Any) -> None:
    """Make `pool` this process's default sandbox pool (what `Sandbox()` without a pool uses)."""
    from posttrain.sandbox import set_default_pool

    set_default_pool(pool)
