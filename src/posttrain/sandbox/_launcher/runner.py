"""One run in one jail: prepare the work dir, spawn bubblewrap, supervise, reap, collect, clean up.

The order matters and each step says why:
1. a fresh tmpfs (size- and inode-capped) is mounted on the slot's mount point, private to the launcher's mount
   namespace, and the request's files are written into it;
2. the launcher spawns bubblewrap as the slot's uid (never root), born in the slot's cgroups (which the launcher
   joined once), and sets its rlimits before bubblewrap may build the jail (`spawn`);
3. the launcher reads stdout/stderr up to the output cap and enforces the wall-clock deadline from outside
   (SIGKILL to bubblewrap, whose PID namespace takes every descendant with it, setsid'd daemons included);
4. every process is reaped (the launcher is their subreaper) and the cgroup is checked empty before the next run;
5. requested files are collected: regular files only, never through a link, never bigger than the budget;
6. after the reply is sent (`release`), the tmpfs is unmounted, which frees everything the run wrote at once.
Standard library only; the launcher imports this by file path.
"""

from __future__ import annotations

import fnmatch
import json
import os
import resource
import select
import signal
import stat
import time

import jail as jail_args
import spawn
import syscalls
import wire
from slot import Slot

_GRACE_S = 2.0  # how long output may keep flowing after bubblewrap exits before the cgroup is emptied by force


def _safe_relpath(path: str) -> str:
    norm = os.path.normpath(path)
    if not path or norm.startswith(("/", "..")) or norm == "." or "\0" in path:
        raise ValueError(f"file path {path!r} must be relative and stay inside the work dir")
    return norm


def _write_files(slot: Slot, root: str, files: dict[str, str]) -> None:
    for path, encoded in files.items():
        relative = _safe_relpath(path)
        target = os.path.join(root, relative)
        parent = os.path.dirname(target)
        if not os.path.isdir(parent):
            os.makedirs(parent, mode=0o755)
            walk = parent
            while walk != root:
                os.chown(walk, slot.uid, slot.gid)
                walk = os.path.dirname(walk)
        content = wire.unpack_bytes(encoded)
        mode = 0o755 if content.startswith(b"#!") else 0o644
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view):]
            os.fchown(fd, slot.uid, slot.gid)
        finally:
            os.close(fd)


def _memfd(name: str, data: bytes) -> int:
    # Any process in the jail can reopen stdin through /proc/1/fd/0 and read it from the start (programs rely
    # on /dev/stdin working), so stdin is never a place for what a judge in the jail must keep from the
    # program it judges: the code harness takes its config from a file it unlinks first.
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class _Supervision:
    """Output, deadline and exit of one jail, watched from the launcher with poll()."""

    def __init__(self, pid: int, out_r: int, err_r: int, info_r: int, control_fd: int, limits: dict,
                 timeout_s: float, cgroups, marks: dict):
        self.marks = marks
        self.pid = pid
        self.limits = limits
        self.cgroups = cgroups
        self.deadline = time.monotonic() + timeout_s
        self.output_cap = int(limits["output_bytes"])
        self.streams = {out_r: bytearray(), err_r: bytearray()}
        self.out_r, self.err_r, self.info_r = out_r, err_r, info_r
        self.info = bytearray()
        self.control_fd = control_fd
        self.killed_for = ""  # "timeout" | "output" | "parent"
        self.truncated = False
        self.wait_status: int | None = None
        self.exited_at: float | None = None
        self.pidfd = os.pidfd_open(pid)

    def _kill(self, reason: str) -> None:
        if not self.killed_for:
            self.killed_for = reason
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.cgroups is not None:
            self.cgroups.kill_all(deadline_s=0.0)

    def _take(self, fd: int) -> bool:
        """Read what is there; False at EOF."""
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        if fd == self.info_r:
            self.marks.setdefault("jail_ready", time.perf_counter())
            self.info += chunk[:4096]
            return True
        buffer = self.streams[fd]
        room = self.output_cap - sum(len(b) for b in self.streams.values())
        buffer += chunk[: max(0, room)]
        if len(chunk) > room:
            self.truncated = True
            self._kill("output")
        return True

    def init_pid(self) -> int:
        """The host pid of bubblewrap's init (pid 1 of the jail), from its info report; 0 if unknown."""
        try:
            pid = json.loads(bytes(self.info)).get("child-pid", 0)
        except (ValueError, AttributeError):
            return 0
        return pid if type(pid) is int else 0

    def watch(self) -> None:
        poller = select.poll()
        open_fds = {self.out_r, self.err_r, self.info_r}
        for fd in open_fds:
            poller.register(fd, select.POLLIN)
        poller.register(self.pidfd, select.POLLIN)
        poller.register(self.control_fd, select.POLLIN)
        while open_fds or self.wait_status is None:
            now = time.monotonic()
            if self.wait_status is None:
                wait_ms = max(0, int((self.deadline - now) * 1000) + 1)
            else:  # exited: a few descendants may still be dying with a pipe open
                wait_ms = max(0, int((self.exited_at + _GRACE_S - now) * 1000) + 1)
            events = poller.poll(wait_ms)
            if not events:
                if self.wait_status is None and not self.killed_for:
                    self._kill("timeout")
                    self.deadline = time.monotonic() + _GRACE_S  # SIGKILL is not instant, but it is soon
                    continue
                break  # still running or writing after SIGKILL and a grace period: the caller cleans up
            for fd, _ in events:
                if fd == self.pidfd:
                    _, self.wait_status = os.waitpid(self.pid, 0)
                    self.exited_at = time.monotonic()
                    self.marks["exited"] = time.perf_counter()
                    poller.unregister(self.pidfd)
                elif fd == self.control_fd:
                    self._kill("parent")  # the trainer went away mid-run: stop the jail and exit
                    poller.unregister(self.control_fd)
                elif not self._take(fd):
                    poller.unregister(fd)
                    open_fds.discard(fd)
        os.close(self.pidfd)


def _await_exit(pid: int, deadline_s: float) -> None:
    """Wait (without polling) until process `pid`, an orphan of ours, has exited, or the deadline passed."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return  # already gone (its parent, bubblewrap's monitor, reaped it)
    try:
        # Only a child of ours is waited for: after the monitor reaped its init, the pid may name a stranger
        # (ChildProcessError). None: ours, and still running.
        if os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            select.select([pidfd], [], [], deadline_s)
    except OSError:
        pass
    finally:
        os.close(pidfd)


def _reap_all(cgroups, deadline_s: float = 2.0, init_pid: int = 0, marks: dict | None = None) -> bool:
    """Reap every orphan this subreaper inherited; True once nothing of the run is left. bubblewrap's monitor
    exits as soon as its init reports the program's exit status, often while that init is still tearing the
    jail's namespaces down (a quarter of the runs, measured): with `init_pid`, that exit is awaited exactly
    instead of by polling the cgroup."""
    end = time.monotonic() + deadline_s
    if init_pid > 0:
        _await_exit(init_pid, deadline_s)
        if marks is not None:
            marks["init_exited"] = time.perf_counter()
    while True:
        try:
            while True:
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
        except ChildProcessError:
            if cgroups is None or not cgroups.procs():
                return True
        if time.monotonic() > end:
            return False
        if cgroups is not None:
            cgroups.kill_all(deadline_s=0.0)
        time.sleep(0.001)


def _collect(root: str, patterns: list[str], budget: int) -> tuple[dict[str, str], dict[str, str]]:
    """Regular files under `root` matching `patterns`; links and special files are refused, never followed."""
    files, refused = {}, {}
    root_dev = os.lstat(root).st_dev
    for directory, dirnames, filenames in os.walk(root, followlinks=False):
        for name in sorted(dirnames + filenames):
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, root)
            if not any(fnmatch.fnmatchcase(relative, p) for p in patterns):
                continue
            info = os.lstat(path)
            if stat.S_ISDIR(info.st_mode):
                continue
            if stat.S_ISLNK(info.st_mode):
                refused[relative] = "symlink"
                continue
            if not stat.S_ISREG(info.st_mode):
                refused[relative] = "not a regular file"
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                opened = os.fstat(fd)
                if opened.st_dev != root_dev or not stat.S_ISREG(opened.st_mode):
                    refused[relative] = "outside the work dir"
                elif opened.st_nlink != 1:
                    refused[relative] = "hard link"
                elif opened.st_size > budget:
                    refused[relative] = "over the collect budget"
                else:
                    data = os.read(fd, opened.st_size + 1)[: opened.st_size]
                    budget -= len(data)
                    files[relative] = wire.pack_bytes(data)
            finally:
                os.close(fd)
    return files, refused


def _status(sup: _Supervision, oom: bool, cpu_s: float, limits: dict) -> tuple[str, int | None, int | None]:
    status_word = sup.wait_status
    if status_word is None:
        return "infra_error", None, None
    if os.WIFSIGNALED(status_word):
        code, sig = None, os.WTERMSIG(status_word)
    else:
        code = os.WEXITSTATUS(status_word)
        # bubblewrap's init reports a command killed by signal N as exit code 128 + N
        sig = code - 128 if 128 < code <= 128 + 64 else None
    if sup.killed_for == "output":
        return "output_limit", code, sig
    if sup.killed_for in ("timeout", "parent"):
        return "timeout", code, sig
    if oom:
        return "oom", code, sig
    if sig in (signal.SIGXCPU, signal.SIGKILL) and cpu_s >= float(limits["cpu_s"]) * 0.9:
        return "timeout", code, sig
    return ("ok" if code == 0 else "runtime_error"), code, sig


def run(slot: Slot, request: dict, control_fd: int) -> dict:
    """One request, start to finish. With ``request["trace"]`` the reply carries ``trace``: milliseconds from
    the start of the run to each phase, for finding where the time goes (bench/sandbox.py prints them)."""
    limits, jail = request["limits"], request["jail"]
    marks = {"start": time.perf_counter()}
    root = slot.mount_point
    workdir_mb = int(limits["workdir_mb"])
    slot_opts = f"size={workdir_mb}m,nr_inodes={max(4096, workdir_mb * 256)},mode=0700,uid={slot.uid},gid={slot.gid}"
    release(slot)  # normally done already, right after the previous run's reply
    syscalls.mount("posttrain-sandbox", root, "tmpfs", syscalls.MS_NOSUID | syscalls.MS_NODEV, slot_opts)
    slot.workdir_mounted = True
    marks["mounted"] = time.perf_counter()
    try:
        response = _run_mounted(slot, request, limits, jail, root, control_fd, marks)
    except BaseException:
        release(slot)
        raise
    if request.get("trace"):
        response["trace"] = {name: round((t - marks["start"]) * 1000, 3) for name, t in marks.items()}
    return response


def release(slot: Slot) -> None:
    """Unmount a finished run's work dir, which frees everything it wrote at once. The launcher calls this after
    sending the run's reply: the unmount waits for an RCU grace period in the kernel (0.2-1 ms), which then
    overlaps with the trainer reading the reply instead of delaying it. No process of the run is alive by then."""
    if slot.workdir_mounted:
        syscalls.umount(slot.mount_point)
        slot.workdir_mounted = False


def _run_mounted(slot: Slot, request: dict, limits: dict, jail: dict, root: str, control_fd: int,
                 marks: dict) -> dict:
    try:
        _write_files(slot, root, request.get("files", {}))
    except (OSError, ValueError) as error:
        return {"status": "infra_error", "error": f"could not write the run's files: {error}"}
    seccomp = slot.seccomp.get(bool(jail.get("nested_namespaces"))) if jail.get("seccomp", True) else None
    try:
        staged = {path: slot.stage(path) for path in jail.get("ro_paths", ())}
    except OSError as error:
        return {"status": "infra_error", "error": f"could not expose a read-only path: {error}"}
    options = jail_args.bwrap_options(root, limits, jail, request.get("env", {}), seccomp is not None, slot.root,
                                      staged)
    if slot.cgroups is not None:
        slot.cgroups.set_limits(int(limits["memory_mb"]) << 20, int(limits["processes"]) + 2)
    before = _Before(slot.cgroups.oom_kills(cached=True) if slot.cgroups is not None else 0,
                     resource.getrusage(resource.RUSAGE_CHILDREN))
    opened: list[int] = []  # every fd made for this run, closed here whatever happens
    try:
        stdin_fd = _memfd("stdin", wire.unpack_bytes(request.get("stdin", "")))
        opened.append(stdin_fd)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        info_r, info_w = os.pipe2(os.O_CLOEXEC)
        opened += [out_r, out_w, err_r, err_w, info_r, info_w]
        for fd in (out_r, err_r, info_r):
            os.set_blocking(fd, False)  # our ends only: the program's stdout/stderr stay blocking
        child_fds = {0: stdin_fd, 1: out_w, 2: err_w, jail_args.INFO_FD: info_w}
        if seccomp is not None:
            child_fds[jail_args.SECCOMP_FD] = _memfd("seccomp", seccomp)
            opened.append(child_fds[jail_args.SECCOMP_FD])
        marks["prepared"] = time.perf_counter()
        started = time.monotonic()
        try:
            before.pid = spawn.spawn_bubblewrap(slot, options, request["argv"], child_fds, limits,
                                                bool(jail.get("network")))
        except OSError as error:
            return {"status": "infra_error", "error": f"could not start bubblewrap: {error}"}
        for fd in child_fds.values():
            os.close(fd)
            opened.remove(fd)
        marks["exec"] = time.perf_counter()
        before.started = started
        return _supervise(slot, request, limits, root, control_fd, marks, before, out_r, err_r, info_r)
    finally:
        for fd in opened:
            os.close(fd)


class _Before:
    """What the launcher noted as the run started, to tell the run's cost and verdict from earlier ones'."""

    def __init__(self, oom_kills: int, usage: resource.struct_rusage):
        self.oom_kills = oom_kills
        self.usage = usage
        self.pid = 0
        self.started = 0.0


def _supervise(slot: Slot, request: dict, limits: dict, root: str, control_fd: int, marks: dict, before: _Before,
               out_r: int, err_r: int, info_r: int) -> dict:
    started = before.started
    sup = _Supervision(before.pid, out_r, err_r, info_r, control_fd, limits, float(request["timeout_s"]), slot.cgroups,
                       marks)
    sup.watch()
    duration = (sup.exited_at or time.monotonic()) - started
    marks["watched"] = time.perf_counter()
    clean = _reap_all(slot.cgroups, init_pid=sup.init_pid(), marks=marks)
    marks["reaped"] = time.perf_counter()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (usage.ru_utime - before.usage.ru_utime) + (usage.ru_stime - before.usage.ru_stime)
    oom = slot.cgroups is not None and slot.cgroups.oom_kills() > before.oom_kills
    status, code, sig = _status(sup, oom, cpu_s, limits)
    error = ""
    if not sup.info and sup.killed_for != "timeout":
        # bubblewrap reports on the info fd once the jail is built; no report means the jail never started
        stderr = bytes(sup.streams[err_r]).decode(errors="replace").strip()
        status, error = "infra_error", f"bubblewrap could not build the jail: {stderr[-500:]}"
    elif not clean:
        status, error = "infra_error", "processes of the run survived the kill; slot restarted"
    response = {
        "status": status, "exit_code": code, "signal": sig, "duration_s": duration, "cpu_s": cpu_s,
        "stdout": wire.pack_bytes(bytes(sup.streams[out_r])), "stderr": wire.pack_bytes(bytes(sup.streams[err_r])),
        "truncated": sup.truncated, "error": error, "parent_gone": sup.killed_for == "parent", "clean": clean,
    }
    if request.get("collect") and status != "infra_error":
        response["files"], response["refused"] = _collect(root, request["collect"], int(limits["collect_bytes"]))
    marks["collected"] = time.perf_counter()
    return response
