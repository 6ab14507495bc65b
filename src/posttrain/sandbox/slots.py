"""Worker slots: each runs one program at a time. `LauncherSlot` drives a bubblewrap launcher process;
`UnsafeLocalSlot` runs the program as a plain subprocess, for platforms without namespaces (no isolation).

A slot is the seam between the pool and a backend (`SandboxSlot`, a Protocol). `LauncherSlot.execute` never
raises for a run that went wrong: a launcher that died, hung or could not start comes back as ``infra_error``
and the next run starts a fresh launcher.
"""

from __future__ import annotations

import fnmatch
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Protocol

from posttrain.sandbox._launcher import wire
from posttrain.sandbox.limits import RunResult, RunStatus
from posttrain.sandbox.request import RunRequest

LAUNCHER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_launcher")
_REPLY_GRACE_S = 15.0  # beyond the run's own timeout, how long a launcher may take to answer before it is killed
_HELLO_TIMEOUT_S = 20.0


class SandboxSlot(Protocol):
    backend: str

    def execute(self, request: RunRequest) -> RunResult: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LauncherSettings:
    bwrap: str
    uid_base: int
    uid_span: int
    tmp_dir: str


def _result_from_reply(reply: dict, backend: str) -> RunResult:
    return RunResult(
        status=RunStatus(reply["status"]),
        exit_code=reply.get("exit_code"),
        signal=reply.get("signal"),
        stdout_bytes=wire.unpack_bytes(reply.get("stdout", "")),
        stderr_bytes=wire.unpack_bytes(reply.get("stderr", "")),
        duration_s=float(reply.get("duration_s", 0.0)),
        cpu_s=float(reply.get("cpu_s", 0.0)),
        truncated=bool(reply.get("truncated", False)),
        files={path: wire.unpack_bytes(data) for path, data in reply.get("files", {}).items()},
        refused_files=dict(reply.get("refused", {})),
        error=reply.get("error", ""),
        backend=backend,
        trace=dict(reply.get("trace", {})),
    )


class LauncherSlot:
    """One launcher process (started on first use, restarted after it dies) and the uid it claimed."""

    backend = "bubblewrap"

    def __init__(self, settings: LauncherSettings):
        self.settings = settings
        self.process: subprocess.Popen | None = None
        self.hello: dict = {}
        self.restarts = 0
        self._started = False
        self.footprint: set[str] = set()  # every host path a launcher of this slot created

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> dict:
        """Start the launcher and return its hello; raises RuntimeError with the launcher's reason."""
        config = {"uid_base": self.settings.uid_base, "uid_span": self.settings.uid_span,
                  "bwrap": self.settings.bwrap, "tmp_dir": self.settings.tmp_dir}
        # No preexec_fn: the trainer is multi-threaded. CPython's fork+exec path runs no Python in the child.
        self.process = subprocess.Popen(
            [sys.executable, "-S", "-E", "-s", LAUNCHER_DIR, json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, start_new_session=True,
            env={"LANG": "C.UTF-8"},
        )
        hello = self._receive(_HELLO_TIMEOUT_S)
        if not hello or not hello.get("ok"):
            self._kill()
            reason = hello.get("error") if hello else "the launcher exited or hung before saying hello"
            raise RuntimeError(reason)
        self.hello = hello
        self._started = True
        self.footprint.update([hello["mount_point"], hello["mount_point"] + "-ro", *hello.get("cgroup_dirs", [])])
        return hello

    def _receive(self, timeout_s: float) -> dict | None:
        assert self.process is not None and self.process.stdout is not None
        fd = self.process.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout_s)
        if not ready:
            return None
        try:
            return wire.recv(fd)
        except (OSError, ValueError):
            return None

    def execute(self, request: RunRequest) -> RunResult:
        started = time.monotonic()
        if not self.alive:
            self._kill()
            self.restarts += int(self._started)
            try:
                self.start()
            except (OSError, RuntimeError) as error:
                return RunResult.infra(f"sandbox launcher could not start: {error}", self.backend)
        assert self.process is not None and self.process.stdin is not None
        try:
            wire.send(self.process.stdin.fileno(), request.to_wire())
        except OSError as error:
            self._kill()
            return RunResult.infra(f"sandbox launcher is gone: {error}", self.backend)
        reply = self._receive(request.timeout_s + _REPLY_GRACE_S)
        if reply is None:
            self._kill()
            return RunResult.infra("sandbox launcher died or stopped answering mid-run", self.backend,
                                   duration_s=time.monotonic() - started)
        if reply.get("clean") is False:
            self._kill()  # it exits by itself; make sure, so the next run starts a fresh launcher
        return _result_from_reply(reply, self.backend)

    def _kill(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        for stream in (process.stdin, process.stdout):
            try:
                stream.close()  # EOF: the launcher kills any jail, removes its cgroups and exits
            except (OSError, AttributeError):
                pass
        try:
            process.wait(timeout=3.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        mount_point = self.hello.get("mount_point")
        if mount_point and process.returncode != 0:
            # Left behind only if the launcher was killed hard. Its mounts lived in its own mount namespace,
            # so from here these are plain empty directories and files.
            shutil.rmtree(mount_point + "-ro", ignore_errors=True)
            for directory in [mount_point, *self.hello.get("cgroup_dirs", [])]:
                _remove_dir(directory)

    def close(self) -> None:
        self._kill()


def _remove_dir(directory: str) -> None:
    """rmdir, after killing what a cgroup directory still holds (a launcher that died mid-run)."""
    procs = os.path.join(directory, "cgroup.procs")
    for _ in range(100):
        try:
            with open(procs) as handle:
                pids = [int(p) for p in handle.read().split()]
        except OSError:
            break
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
    try:
        os.rmdir(directory)
    except OSError:
        pass


class UnsafeLocalSlot:
    """Runs the command as a plain subprocess in a temporary directory: NO isolation, NO resource limits except
    the wall-clock timeout and the output cap. For platforms without namespaces; warns on every run."""

    backend = "unsafe-local"

    def execute(self, request: RunRequest) -> RunResult:
        warnings.warn(
            "posttrain sandbox backend 'unsafe-local' runs untrusted code WITHOUT isolation "
            "(no namespaces, no uid change, no memory/process limits)", UnsafeSandboxWarning, stacklevel=4)
        workdir = tempfile.mkdtemp(prefix="posttrain-unsafe-")
        try:
            return self._run_in(workdir, request)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _run_in(self, workdir: str, request: RunRequest) -> RunResult:
        for path, content in request.files.items():
            target = os.path.join(workdir, path)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as handle:
                handle.write(content)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8",
               "TMPDIR": workdir, **request.env}
        started = time.monotonic()
        try:
            process = subprocess.Popen(request.argv, cwd=workdir, env=env, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except OSError as error:
            return RunResult(status=RunStatus.RUNTIME_ERROR, exit_code=127, stderr_bytes=str(error).encode(),
                             backend=self.backend)
        out, err, killed_for = _pump(process, request.stdin, request.limits.output_bytes, request.timeout_s)
        duration = time.monotonic() - started
        code = process.returncode
        sig = -code if code is not None and code < 0 else None
        if killed_for == "output":
            status = RunStatus.OUTPUT_LIMIT
        elif killed_for == "timeout":
            status = RunStatus.TIMEOUT
        else:
            status = RunStatus.OK if code == 0 else RunStatus.RUNTIME_ERROR
        result = RunResult(status=status, exit_code=code if code is not None and code >= 0 else None, signal=sig,
                           stdout_bytes=out, stderr_bytes=err, duration_s=duration,
                           truncated=killed_for == "output", backend=self.backend)
        if request.collect:
            result.files, result.refused_files = _collect_local(workdir, request.collect)
        return result

    def close(self) -> None:
        pass


class UnsafeSandboxWarning(UserWarning):
    """Untrusted code ran without isolation."""


warnings.simplefilter("always", UnsafeSandboxWarning)


def _pump(process: subprocess.Popen, stdin: bytes, cap: int, timeout_s: float) -> tuple[bytes, bytes, str]:
    """Feed stdin, read stdout/stderr up to `cap` bytes in total, kill the process group on timeout/flood."""
    out, err = bytearray(), bytearray()
    killed_for = ""
    writer = threading.Thread(target=_feed, args=(process, stdin), daemon=True)
    writer.start()
    streams = {process.stdout.fileno(): out, process.stderr.fileno(): err}  # type: ignore[union-attr]
    deadline = time.monotonic() + timeout_s
    while streams:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            killed_for = killed_for or "timeout"
            break
        ready, _, _ = select.select(list(streams), [], [], remaining)
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                del streams[fd]
                continue
            room = cap - len(out) - len(err)
            streams[fd] += chunk[: max(0, room)]
            if len(chunk) > room:
                killed_for = "output"
                streams.clear()
                break
    if killed_for:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        process.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        killed_for = killed_for or "timeout"
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for stream in (process.stdout, process.stderr):
        stream.close()  # type: ignore[union-attr]
    return bytes(out), bytes(err), killed_for


def _collect_local(root: str, patterns: list[str]) -> tuple[dict[str, bytes], dict[str, str]]:
    files, refused = {}, {}
    for directory, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, root)
            if not any(fnmatch.fnmatchcase(relative, p) for p in patterns) or os.path.isdir(path):
                continue
            if os.path.islink(path) or not os.path.isfile(path):
                refused[relative] = "symlink" if os.path.islink(path) else "not a regular file"
                continue
            with open(path, "rb") as handle:
                files[relative] = handle.read()
    return files, refused


def _feed(process: subprocess.Popen, data: bytes) -> None:
    try:
        process.stdin.write(data)  # type: ignore[union-attr]
        process.stdin.close()  # type: ignore[union-attr]
    except OSError:
        pass
