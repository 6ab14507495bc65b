"""`SandboxPool`: a fixed number of worker slots, each running one jail at a time, shared by threads and asyncio.

Concurrency is bounded by the number of slots (default: one per CPU). Callers that find every slot busy wait:
`run` blocks, `arun` awaits (on a thread of the pool's own executor, so the event loop keeps serving), and
`submit` - for producers that fire and forget - blocks once ``max_pending`` runs are queued. That waiting is
the backpressure: rollouts cannot outrun the sandboxes.

Before its first run the pool proves it can jail a trivial program, and raises `SandboxError` naming the fix if
it cannot. After that, a failing jail is an ``infra_error`` result, counted in `stats`, never an exception.
"""

from __future__ import annotations

import asyncio
import os
import queue
import sys
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from posttrain.sandbox.errors import SandboxError
from posttrain.sandbox.limits import JailOptions, Limits, RunResult
from posttrain.sandbox.preflight import explain_jail_failure, find_bubblewrap
from posttrain.sandbox.request import RunRequest
from posttrain.sandbox.slots import LauncherSettings, LauncherSlot, SandboxSlot, UnsafeLocalSlot

BACKENDS = ("bubblewrap", "unsafe-local")
DEFAULT_UID_BASE = 1_990_000_000  # systemd leaves 1879048192-2147483647 unused; one uid per live slot from here
UID_SPAN = 4096


@dataclass
class PoolStats:
    runs: int = 0
    infra_errors: int = 0
    busy: int = 0
    waiting: int = 0
    launcher_restarts: int = 0


class SandboxPool:
    """Worker slots for sandboxed runs. Use as a context manager, or call `close` (the default pool closes at
    exit). ``backend="unsafe-local"`` runs programs without any isolation and warns on every run."""

    def __init__(
        self,
        slots: int | None = None,
        *,
        backend: str = "bubblewrap",
        bwrap: str | None = None,
        uid_base: int = DEFAULT_UID_BASE,
        max_pending: int | None = None,
        tmp_dir: str | None = None,
    ):
        if backend not in BACKENDS:
            raise SandboxError(f"unknown sandbox backend {backend!r}; known: {', '.join(BACKENDS)}")
        self.size = int(slots or os.cpu_count() or 1)
        if self.size < 1:
            raise SandboxError(f"a SandboxPool needs at least one slot, got {slots!r}")
        self.backend = backend
        self._slots: list[SandboxSlot]
        if backend == "bubblewrap":
            if not sys.platform.startswith("linux"):
                raise SandboxError("the bubblewrap sandbox needs Linux namespaces; on this platform use "
                                   "SandboxPool(backend='unsafe-local'), which does NOT isolate programs")
            settings = LauncherSettings(find_bubblewrap(bwrap), int(uid_base), UID_SPAN,
                                        tmp_dir or tempfile.gettempdir())
            self._slots = [LauncherSlot(settings) for _ in range(self.size)]
        else:
            self._slots = [UnsafeLocalSlot() for _ in range(self.size)]
        self._idle: queue.LifoQueue[SandboxSlot] = queue.LifoQueue()  # LIFO: the warmest slot goes first
        for slot in self._slots:
            self._idle.put(slot)
        self._admission = threading.BoundedSemaphore(max_pending or 4 * self.size)
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._checked = backend != "bubblewrap"
        self._capabilities: dict[str, Any] = {"backend": backend}
        self._stats = PoolStats()
        self._closed = False
        self._owner_pid = os.getpid()

    # ---- running -------------------------------------------------------------------------------

    def execute(self, request: RunRequest) -> RunResult:
        """Run one request on the next free slot, waiting for one if all are busy."""
        self._check_usable()
        if not self._checked:
            self._preflight()
        with self._lock:
            self._stats.waiting += 1
        slot = self._idle.get()
        with self._lock:
            self._stats.waiting -= 1
            self._stats.busy += 1
        try:
            result = slot.execute(request)
        finally:
            with self._lock:
                self._stats.busy -= 1
            self._idle.put(slot)
        with self._lock:
            self._stats.runs += 1
            self._stats.infra_errors += int(result.is_infra_error)
        return result

    async def aexecute(self, request: RunRequest) -> RunResult:
        """`execute` for asyncio: waits for a slot without blocking the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool_executor(), self.execute, request)

    def submit(self, request: RunRequest) -> Future:
        """Queue a run and return its Future; blocks while ``max_pending`` runs are already queued."""
        self._check_usable()
        self._admission.acquire()
        try:
            future = self._pool_executor().submit(self.execute, request)
        except BaseException:
            self._admission.release()
            raise
        future.add_done_callback(lambda _: self._admission.release())
        return future

    def _pool_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="posttrain-sandbox")
            return self._executor

    # ---- start-up check and introspection --------------------------------------------------------

    def _preflight(self) -> None:
        with self._lock:
            if self._checked:
                return
            slot = self._slots[0]
            assert isinstance(slot, LauncherSlot)
            try:
                hello = slot.start()
            except (OSError, RuntimeError) as error:
                raise explain_jail_failure(str(error)) from None
            probe = RunRequest.build(["true"], Limits(), JailOptions(), timeout_s=10.0)
            result = slot.execute(probe)
            if not result.ok:
                raise explain_jail_failure(result.error or result.stderr or str(result.status))
            self._capabilities = {
                "backend": self.backend,
                "slot_uid_per_worker": bool(hello.get("root")),
                "memory_limit": bool(hello.get("cgroups")),
                "cgroup_version": hello.get("cgroups", 0),
                "seccomp": bool(hello.get("seccomp")),
            }
            self._checked = True

    def capabilities(self) -> dict[str, Any]:
        """Which protections this machine gives (memory cgroup, seccomp, one uid per slot ...)."""
        if not self._checked:
            self._preflight()
        return dict(self._capabilities)

    def slot_uids(self) -> list[int]:
        """The uids the live launchers run programs as (for tests that look for stray processes)."""
        return [s.hello["uid"] for s in self._slots if isinstance(s, LauncherSlot) and s.hello]

    def footprint(self) -> set[str]:
        """Every temp dir and cgroup this pool's launchers created (all gone once it is closed)."""
        return set().union(*(getattr(s, "footprint", set()) for s in self._slots))

    def stats(self) -> PoolStats:
        with self._lock:
            stats = PoolStats(**vars(self._stats))
        stats.launcher_restarts = sum(getattr(s, "restarts", 0) for s in self._slots)
        return stats

    def _check_usable(self) -> None:
        if self._closed:
            raise SandboxError("this SandboxPool is closed")
        if os.getpid() != self._owner_pid:
            raise SandboxError("a SandboxPool cannot be used across fork(); create a new one in the child process")

    # ---- shutdown ------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        for slot in self._slots:
            slot.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
