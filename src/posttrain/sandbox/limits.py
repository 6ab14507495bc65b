"""What a sandboxed run may use (`Limits`), what it may see (`JailOptions`) and what it returns (`RunResult`).

Every limit has a default a task can override (``Limits().replace(timeout_s=2)``). Every run returns a
`RunStatus`; ``infra_error`` means the jail itself failed and is never the program's fault: callers retry it and
count it, and verifiers turn it into ``FailureClass.SANDBOX`` instead of a reward of 0.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from posttrain.sandbox.errors import SandboxError


class RunStatus(str, enum.Enum):
    OK = "ok"  # exited 0
    RUNTIME_ERROR = "runtime_error"  # non-zero exit or killed by a signal of its own making
    TIMEOUT = "timeout"  # wall clock or CPU seconds ran out
    OOM = "oom"  # the memory cgroup killed it
    OUTPUT_LIMIT = "output_limit"  # stdout + stderr passed ``Limits.output_bytes``; output truncated
    INFRA_ERROR = "infra_error"  # the jail could not run the program: retry, never score

    def __str__(self) -> str:  # so f-strings and logs show "ok", not "RunStatus.OK"
        return self.value


@dataclass(frozen=True)
class Limits:
    """Per-run resource limits. Sizes in MiB unless the name says bytes.

    ``memory_mb`` is enforced by a memory cgroup where one is available (see `SandboxPool.capabilities`);
    ``address_space_mb`` (RLIMIT_AS) is an opt-in, because glibc's per-thread arenas make a tight address-space
    limit refuse threads long before the memory is used. ``processes`` counts processes and threads.
    """

    timeout_s: float = 10.0  # wall clock, enforced from outside the jail with SIGKILL
    cpu_s: float = 10.0  # CPU seconds per process (RLIMIT_CPU)
    memory_mb: int = 512  # memory cgroup limit (includes the jail's tmpfs pages)
    address_space_mb: int | None = None  # RLIMIT_AS, off unless asked for
    processes: int = 64  # pids cgroup and RLIMIT_NPROC of the slot's uid
    file_size_mb: int = 32  # largest file the program may write (RLIMIT_FSIZE)
    open_files: int = 256  # RLIMIT_NOFILE
    output_bytes: int = 1 << 20  # stdout + stderr kept; past this the run is stopped and flagged
    workdir_mb: int = 64  # size of the private work dir (a tmpfs)
    tmp_mb: int = 32  # size of /tmp and of /dev/shm (each a tmpfs)
    collect_bytes: int = 16 << 20  # total size of the files collected after the run

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if value is None and spec.name == "address_space_mb":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise SandboxError(f"Limits.{spec.name} must be a positive number, got {value!r}")

    def replace(self, **overrides: Any) -> Limits:
        """A copy with some limits changed; an unknown name is an error that lists the known ones."""
        known = {spec.name for spec in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise SandboxError(f"unknown sandbox limit(s) {unknown}; known: {', '.join(sorted(known))}")
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        # every field is a number: a shallow read (dataclasses.asdict deep-copies, ~0.1 ms on every run)
        return {spec.name: getattr(self, spec.name) for spec in dataclasses.fields(self)}


@dataclass(frozen=True)
class JailOptions:
    """What the jail shows the program, and which protections are on.

    ``python`` is the interpreter `Sandbox.run_python` runs (looked up on the jail's PATH unless absolute);
    ``ro_paths`` are extra host paths bound read-only at the same place (e.g. a virtualenv with the packages a
    scorer needs). The four switches below exist so tests can prove each protection matters; every run with one
    of them off warns.
    """

    python: str = "python3"
    ro_paths: tuple[str, ...] = ()
    network: bool = False  # share the host's network namespace
    nested_namespaces: bool = False  # allow user namespaces / unshare inside the jail
    readonly_root: bool = True  # remount the jail's / and /dev read-only
    seccomp: bool = True  # deny ptrace, mount, bpf, keyctl ... (x86_64)

    def __post_init__(self) -> None:
        if not isinstance(self.ro_paths, tuple):
            object.__setattr__(self, "ro_paths", tuple(self.ro_paths))
        for path in self.ro_paths:
            if not isinstance(path, str) or not path.startswith("/"):
                raise SandboxError(f"JailOptions.ro_paths must be absolute paths, got {path!r}")
            if not os.path.exists(path):
                raise SandboxError(f"JailOptions.ro_paths: {path} does not exist")

    @property
    def weakened(self) -> list[str]:
        """The protections this jail runs without."""
        off = []
        if self.network:
            off.append("network")
        if self.nested_namespaces:
            off.append("nested_namespaces")
        if not self.readonly_root:
            off.append("readonly_root")
        if not self.seccomp:
            off.append("seccomp")
        return off

    def warn_if_weakened(self) -> None:
        if self.weakened:
            warnings.warn(f"sandbox run with protections off: {', '.join(self.weakened)}", stacklevel=3)

    def to_dict(self) -> dict[str, Any]:
        data = {spec.name: getattr(self, spec.name) for spec in dataclasses.fields(self)}
        data["ro_paths"] = list(self.ro_paths)
        return data


@dataclass
class RunResult:
    """What one run produced. ``stdout``/``stderr`` are the captured bytes decoded as UTF-8 (invalid bytes
    replaced); the exact bytes are in ``stdout_bytes``/``stderr_bytes``. ``files`` holds the collected files
    (regular files inside the work dir); ``refused_files`` says which were not collected and why."""

    status: RunStatus
    exit_code: int | None = None
    signal: int | None = None
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    duration_s: float = 0.0
    cpu_s: float = 0.0
    truncated: bool = False
    files: dict[str, bytes] = field(default_factory=dict)
    refused_files: dict[str, str] = field(default_factory=dict)
    error: str = ""  # for infra_error: what went wrong
    backend: str = ""
    trace: dict[str, float] = field(default_factory=dict)  # ms from the run's start to each phase, if asked

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.status is RunStatus.OK

    @property
    def is_infra_error(self) -> bool:
        return self.status is RunStatus.INFRA_ERROR

    @classmethod
    def infra(cls, error: str, backend: str = "", duration_s: float = 0.0) -> RunResult:
        return cls(status=RunStatus.INFRA_ERROR, error=error, backend=backend, duration_s=duration_s)
