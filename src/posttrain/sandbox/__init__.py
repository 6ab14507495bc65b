"""Isolated execution of untrusted code: one fresh bubblewrap jail per run, behind a pool of worker slots.

Each run gets its own network, PID, IPC, UTS and user namespaces; a read-only system (``/`` and ``/dev`` too);
a private size-capped work dir and /tmp as the only writable places; an unprivileged uid per worker slot; and
limits on wall time, CPU, memory (cgroup), processes, file size, open files and output. The whole process tree
dies at the end of the run. Jails are launched by single-threaded helper processes (one per slot) that reap
orphans, never from the trainer's own threads.

    from posttrain.sandbox import Sandbox, Limits
    result = Sandbox(Limits(timeout_s=2)).run_python("print(1 + 1)")
    assert result.status == "ok" and result.stdout == "2\\n"

See docs/sandbox.md for the design, the threat model and the measured overhead.
"""

from posttrain.sandbox.errors import SandboxError
from posttrain.sandbox.limits import JailOptions, Limits, RunResult, RunStatus
from posttrain.sandbox.pool import PoolStats, SandboxPool
from posttrain.sandbox.preflight import find_bubblewrap
from posttrain.sandbox.request import RunRequest, check_file_name, file_conflicts, python_runtime_paths
from posttrain.sandbox.sandbox import Sandbox, default_pool, local_pool, set_default_pool
from posttrain.sandbox.slots import UnsafeSandboxWarning

__all__ = [
    "JailOptions",
    "Limits",
    "PoolStats",
    "RunRequest",
    "RunResult",
    "RunStatus",
    "Sandbox",
    "SandboxError",
    "SandboxPool",
    "UnsafeSandboxWarning",
    "check_file_name",
    "default_pool",
    "local_pool",
    "set_default_pool",
    "file_conflicts",
    "find_bubblewrap",
    "python_runtime_paths",
]
