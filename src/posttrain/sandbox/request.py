"""One run, as the trainer asks for it: the command, the files, stdin, limits, jail options, what to collect.

Building a `RunRequest` checks the caller's side of the contract (a relative path per file, a non-empty command,
text or bytes) and raises `SandboxError` for a mistake; what the program then does is never an exception.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence, Union

from posttrain.sandbox._launcher import wire
from posttrain.sandbox.errors import SandboxError
from posttrain.sandbox.limits import JailOptions, Limits

FileContent = Union[str, bytes]


MAX_NAME_BYTES = 1024  # a file's name relative to the work dir, in UTF-8 (the OS's PATH_MAX includes the dir)
MAX_PART_BYTES = 255  # one component (the OS's NAME_MAX)


def _as_bytes(value: FileContent, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        try:
            return value.encode("utf-8", errors="surrogateescape")
        except UnicodeEncodeError as error:
            raise SandboxError(f"{what} is not UTF-8 text ({error.reason} at {error.start})") from None
    raise SandboxError(f"{what} must be str or bytes, got {type(value).__name__}")


def check_file_name(path: str) -> str:
    """`path` normalized if the work dir can hold a file by that name; SandboxError otherwise."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise SandboxError(f"file name {path!r} must be a non-empty string")
    norm = posixpath.normpath(path)
    if norm.startswith("/") or norm == ".." or norm.startswith("../") or norm == ".":
        raise SandboxError(f"file name {path!r} must be relative to the work dir and stay inside it")
    try:
        encoded = norm.encode("utf-8")
    except UnicodeEncodeError:
        raise SandboxError(f"file name {path!r} is not UTF-8 text") from None
    if len(encoded) > MAX_NAME_BYTES or any(len(part) > MAX_PART_BYTES for part in encoded.split(b"/")):
        raise SandboxError(f"file name {path[:80]!r}... is too long ({MAX_NAME_BYTES} bytes in all, "
                           f"{MAX_PART_BYTES} a component)")
    return norm


def file_conflicts(names: Iterable[str]) -> list[tuple[str, str]]:
    """(a file, a name under it) for every name that needs another name as its directory: one tree cannot
    hold both (normalized names, `check_file_name`'s)."""
    files = set(names)
    return [(parent, name) for name in sorted(files) for parent in _parents(name) if parent in files]


def _parents(name: str) -> list[str]:
    parts = name.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


@dataclass
class RunRequest:
    argv: list[str]
    limits: Limits
    jail: JailOptions
    timeout_s: float
    files: dict[str, bytes] = field(default_factory=dict)
    stdin: bytes = b""
    collect: list[str] = field(default_factory=list)  # glob patterns relative to the work dir
    env: dict[str, str] = field(default_factory=dict)
    trace: bool = False  # ask the launcher for per-phase timings (RunResult.trace)

    @classmethod
    def build(
        cls,
        cmd: Sequence[str] | str,
        limits: Limits,
        jail: JailOptions,
        files: Mapping[str, FileContent] | None = None,
        stdin: FileContent | None = None,
        timeout_s: float | None = None,
        collect: Sequence[str] | bool | None = None,
        env: Mapping[str, str] | None = None,
        trace: bool = False,
    ) -> RunRequest:
        if isinstance(cmd, str):
            raise SandboxError("cmd must be a list of arguments (no shell): e.g. ['python3', 'main.py']")
        argv = list(cmd)
        if not argv or not all(isinstance(a, str) and "\0" not in a for a in argv):
            raise SandboxError(f"cmd must be a non-empty list of strings without NUL bytes, got {cmd!r}")
        checked_files = {check_file_name(p): _as_bytes(c, f"content of {p!r}") for p, c in (files or {}).items()}
        conflicts = file_conflicts(checked_files)
        if conflicts:
            parent, name = conflicts[0]
            raise SandboxError(f"file names {parent!r} and {name!r} conflict: {parent!r} cannot be a file and a "
                               "directory at once")
        total = sum(len(c) for c in checked_files.values())
        if total > limits.workdir_mb << 20:
            raise SandboxError(f"files total {total} bytes, more than the work dir's {limits.workdir_mb} MiB "
                               "(raise Limits.workdir_mb)")
        timeout = limits.timeout_s if timeout_s is None else float(timeout_s)
        if not timeout > 0:
            raise SandboxError(f"timeout_s must be positive, got {timeout_s!r}")
        if collect is True:
            patterns = ["*"]
        elif not collect:
            patterns = []
        else:
            patterns = [str(p) for p in collect]
        environment = {}
        for key, value in (env or {}).items():
            if not isinstance(key, str) or not key or "=" in key or "\0" in key or "\0" in str(value):
                raise SandboxError(f"bad environment variable name or value: {key!r}")
            environment[key] = str(value)
        return cls(argv=argv, limits=limits, jail=jail, timeout_s=timeout, files=checked_files,
                   stdin=_as_bytes(stdin, "stdin") if stdin is not None else b"", collect=patterns,
                   env=environment, trace=bool(trace))

    def to_wire(self) -> dict:
        return {
            "argv": self.argv,
            "files": {path: wire.pack_bytes(content) for path, content in self.files.items()},
            "stdin": wire.pack_bytes(self.stdin),
            "limits": self.limits.to_dict(),
            "jail": self.jail.to_dict(),
            "timeout_s": self.timeout_s,
            "collect": self.collect,
            "env": self.env,
            "trace": self.trace,
        }


def python_runtime_paths(executable: str) -> tuple[str, ...]:
    """The host paths an interpreter needs inside the jail: its installation and, for a virtualenv, the venv.

    For `JailOptions(python=executable, ro_paths=python_runtime_paths(executable))`, e.g. to run a scorer with
    the trainer's own packages. Paths under /usr are already in every jail and are left out.
    """
    real = os.path.realpath(executable)
    paths = set()
    for candidate in (os.path.dirname(os.path.dirname(real)), os.path.dirname(os.path.dirname(executable))):
        if candidate and candidate != "/" and not candidate.startswith("/usr"):
            paths.add(candidate)
    return tuple(sorted(paths))
