"""`Sandbox`: limits and jail options, bound to a pool of worker slots; the API the rest of posttrain calls.

    sandbox = Sandbox(Limits(timeout_s=5))
    result = sandbox.run_python("print(input()[::-1])", stdin="abc")     # result.status == "ok", stdout "cba\\n"
    result = await sandbox.arun(["sh", "-c", "ls"], files={"a.txt": "hi"})

Without a pool given, every `Sandbox` shares one default pool (a slot per CPU), created on first use and closed
at exit; `local_pool()` is a pool that surely runs on this machine (the default one, unless that was made remote).
Nothing is retried here: an ``infra_error`` result is the caller's to retry and count.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any, Mapping, Sequence

from posttrain.sandbox.limits import JailOptions, Limits, RunResult
from posttrain.sandbox.pool import SandboxPool
from posttrain.sandbox.request import FileContent, RunRequest

# This process's pools: "default" (what a `Sandbox` without a pool uses; `set_default_pool` may make it remote),
# "local" (bubblewrap on this machine, when the default is not) and "local:N" (`local_pool(N)`). Each is
# (pool, the pid that made it): a forked child makes its own.
_pools: dict[str, tuple[Any, int]] = {}
_pools_lock = threading.Lock()


def _own(kind: str) -> Any | None:
    entry = _pools.get(kind)
    return entry[0] if entry is not None and entry[1] == os.getpid() else None


def _own_or_new(kind: str, slots: int | None = None) -> Any:
    pool = _own(kind)
    if pool is None:
        pool = SandboxPool(slots) if slots else SandboxPool()
        _pools[kind] = (pool, os.getpid())
    return pool


def default_pool() -> SandboxPool:
    """The process-wide pool shared by every `Sandbox` built without one (re-created in a forked child)."""
    with _pools_lock:
        return _own_or_new("default")


def set_default_pool(pool: SandboxPool) -> None:
    """Make `pool` this process's default (e.g. a pool that sends runs to remote sandbox workers). Any
    object with the pool's `execute`/`aexecute` methods will do; the previous default is not closed."""
    with _pools_lock:
        _pools["default"] = (pool, os.getpid())


def local_pool(slots: int | None = None) -> SandboxPool:
    """A bubblewrap pool on this machine, for runs that must happen beside this process (a jail that reaches
    a unix socket of the process, say): the default pool when it is a local `SandboxPool`, else -- the default
    sends runs elsewhere (`set_default_pool`: Ray's sandbox workers) -- a pool of this process's own, made on
    first use (a slot per CPU), re-made in a forked child and closed at exit. With ``slots``: a pool of this
    process's own of that many slots (one per size), for runs that hold a slot while they wait on something
    else (an agent waiting on the model), so more of them can wait at once than there are CPUs."""
    with _pools_lock:
        if slots:
            return _own_or_new(f"local:{slots}", slots)
        default = _own_or_new("default")
        return default if isinstance(default, SandboxPool) else _own_or_new("local")


@atexit.register
def _close_pools() -> None:
    for kind in list(_pools):
        pool = _own(kind)
        if pool is not None and hasattr(pool, "close"):
            pool.close()


class Sandbox:
    """Run untrusted programs in fresh jails. ``limits`` are the defaults of every run (a run may pass its
    own); ``jail`` says what the jail shows; ``pool`` is where the runs go (default: the shared pool)."""

    def __init__(self, limits: Limits | None = None, *, pool: SandboxPool | None = None,
                 jail: JailOptions | None = None):
        self.limits = limits or Limits()
        self.jail = jail or JailOptions()
        self._pool = pool

    @property
    def pool(self) -> SandboxPool:
        return self._pool if self._pool is not None else default_pool()

    def request(
        self,
        cmd: Sequence[str],
        *,
        files: Mapping[str, FileContent] | None = None,
        stdin: FileContent | None = None,
        timeout_s: float | None = None,
        collect: Sequence[str] | bool | None = None,
        env: Mapping[str, str] | None = None,
        limits: Limits | None = None,
        trace: bool = False,
    ) -> RunRequest:
        self.jail.warn_if_weakened()
        return RunRequest.build(cmd, limits or self.limits, self.jail, files=files, stdin=stdin,
                                timeout_s=timeout_s, collect=collect, env=env, trace=trace)

    def python_request(self, code: str, *, files: Mapping[str, FileContent] | None = None,
                       args: Sequence[str] = (), script: str = "main.py", **options) -> RunRequest:
        return self.request([self.jail.python, "-B", "-s", script, *args], files={**(files or {}), script: code},
                            **options)

    def run(self, cmd: Sequence[str], **options) -> RunResult:
        """Run `cmd` (a list, no shell) in a fresh jail. Options: files={path: content}, stdin, timeout_s,
        collect (glob patterns, or True for every file), env, limits."""
        return self.pool.execute(self.request(cmd, **options))

    def run_python(self, code: str, **options) -> RunResult:
        """Run Python source as ``main.py`` in the work dir; same options as `run`, plus args and script."""
        return self.pool.execute(self.python_request(code, **options))

    async def arun(self, cmd: Sequence[str], **options) -> RunResult:
        return await self.pool.aexecute(self.request(cmd, **options))

    async def arun_python(self, code: str, **options) -> RunResult:
        return await self.pool.aexecute(self.python_request(code, **options))
