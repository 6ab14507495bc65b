"""Per-slot memory and pids cgroups: the memory limit, the OOM verdict and a count of what is still alive.

cgroup v1 (separate ``memory`` and ``pids`` hierarchies) is used when both are mounted and writable; cgroup v2
when the launcher's own cgroup delegates the ``memory`` and ``pids`` controllers. Otherwise `SlotCgroups.open`
returns None and the sandbox runs without a memory limit (RLIMIT_NPROC still bounds processes).
A slot's cgroups live as long as its launcher, and the launcher itself sits in them, so each run's processes
are born inside. Moving a process between cgroups per run instead costs a synchronize_rcu() in the kernel
(measured: ~12 ms per run on this kind of machine, more than the whole jail); joining once costs it once.
The launcher's own memory is measured when it joins and added to every run's limit; it protects itself from
the OOM killer (oom_score_adj -1000) and makes the runs its preferred victims.
Standard library only; the launcher imports this by file path.
"""

from __future__ import annotations

import os
import signal
import time


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of every cgroup mount."""
    found = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            left, _, right = line.partition(" - ")
            fstype, _, super_options = (right.split() + ["", "", ""])[:3]
            if fstype in ("cgroup", "cgroup2"):
                found.append((left.split()[4], fstype, set(super_options.split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """Our cgroup path per v1 controller, and under "" for v2."""
    paths = {}
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


def _write(path: str, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)


def _read(path: str) -> str:
    # os-level calls: a few of these run per run, and io.open's buffered text wrapper costs three times as much
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode()


def remove_stale(prefix: str) -> None:
    """Empty and delete every cgroup named `prefix`... next to ours (launchers that died without cleaning up)."""
    try:
        own, mounts = _own_paths(), _mounts()
    except OSError:
        return
    parents = set()
    for point, fstype, options in mounts:
        for controller in ("memory", "pids", ""):
            if controller in own and ((fstype == "cgroup" and controller in options) or
                                      (fstype == "cgroup2" and controller == "")):
                parents.add(point + own[controller])
    for parent in parents:
        try:
            names = [n for n in os.listdir(parent) if n.startswith(prefix)]
        except OSError:
            continue
        for name in names:
            stale = SlotCgroups(1, os.path.join(parent, name), os.path.join(parent, name))
            stale.remove(leave=False)


class SlotCgroups:
    """The memory and pids cgroups of one slot, named after its uid."""

    def __init__(self, version: int, memory_dir: str, pids_dir: str):
        self.version = version
        self.memory_dir = memory_dir
        self.pids_dir = pids_dir
        self._memory_bytes = -1
        self._pids_max = -1
        self._oom_kills = -1  # the counter as last read
        self.baseline_bytes = 0  # the launcher's own charge, measured when it joined

    @classmethod
    def open(cls, name: str) -> SlotCgroups | None:
        try:
            own = _own_paths()
            mounts = _mounts()
        except OSError:
            return None
        v1 = {}
        for point, fstype, options in mounts:
            for controller in ("memory", "pids"):
                if fstype == "cgroup" and controller in options and controller in own:
                    v1[controller] = os.path.join(point + own[controller], name)
        candidates = []
        if len(v1) == 2:
            candidates.append(cls(1, v1["memory"], v1["pids"]))
        for point, fstype, _ in mounts:
            if fstype == "cgroup2" and "" in own:
                parent = point + own[""]
                try:
                    delegated = set(_read(os.path.join(parent, "cgroup.subtree_control")).split())
                except OSError:
                    continue
                if {"memory", "pids"} <= delegated:
                    directory = os.path.join(parent, name)
                    candidates.append(cls(2, directory, directory))
        for cgroups in candidates:
            try:
                cgroups._create()
                return cgroups
            except OSError:
                cgroups.remove()
        return None

    def _create(self) -> None:
        for directory in {self.memory_dir, self.pids_dir}:
            os.makedirs(directory, exist_ok=True)

    def _memory_files(self) -> list[str]:
        if self.version == 2:
            return ["memory.max", "memory.swap.max"]
        return ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]

    def join(self) -> None:
        """Move the launcher itself in (once); every process it spawns is then born inside."""
        pid = str(os.getpid())
        for directory in {self.memory_dir, self.pids_dir}:
            _write(os.path.join(directory, "cgroup.procs"), pid)
        usage = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        try:
            self.baseline_bytes = int(_read(os.path.join(self.memory_dir, usage)))
        except (OSError, ValueError):
            self.baseline_bytes = 64 << 20
        self.baseline_bytes += 8 << 20  # headroom for the launcher's own growth while it serves a run

    def set_limits(self, memory_bytes: int, pids_max: int) -> None:
        """Limits for the next run: its memory plus the launcher's, its processes plus the launcher."""
        memory_bytes += self.baseline_bytes
        pids_max += 1
        if memory_bytes != self._memory_bytes:
            files = [os.path.join(self.memory_dir, f) for f in self._memory_files()]
            main, swap = files
            if self.version == 2:
                _write(main, str(memory_bytes))
                if os.path.exists(swap):
                    _write(swap, "0")
            else:
                # v1 requires memory <= memsw at every moment, so the right order of the two writes depends on
                # the values already there: try lowering first, and the other order if the kernel refuses.
                paths = [p for p in (main, swap) if os.path.exists(p)]
                try:
                    for path in paths:
                        _write(path, str(memory_bytes))
                except OSError:
                    for path in reversed(paths):
                        _write(path, str(memory_bytes))
            self._memory_bytes = memory_bytes
        if pids_max != self._pids_max:
            _write(os.path.join(self.pids_dir, "pids.max"), str(pids_max))
            self._pids_max = pids_max

    def oom_kills(self, cached: bool = False) -> int:
        """The cgroup's OOM-kill counter. With `cached`, the value read at the end of the previous run, if any:
        nothing of this slot runs between two runs, so it cannot have moved."""
        if cached and self._oom_kills >= 0:
            return self._oom_kills
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        count = 0
        try:
            for line in _read(os.path.join(self.memory_dir, name)).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    count = int(value)
                    break
        except (OSError, ValueError):
            pass
        self._oom_kills = count
        return count

    def procs(self) -> list[int]:
        """Every process in the cgroups except the launcher itself."""
        pids = set()
        for directory in {self.memory_dir, self.pids_dir}:
            try:
                pids.update(int(p) for p in _read(os.path.join(directory, "cgroup.procs")).split())
            except OSError:
                pass
        pids.discard(os.getpid())
        return sorted(pids)

    def kill_all(self, deadline_s: float = 2.0) -> bool:
        """SIGKILL everything still in the cgroups; True once they are empty."""
        end = time.monotonic() + deadline_s
        while True:
            pids = self.procs()
            if not pids:
                return True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if time.monotonic() > end:
                return False
            time.sleep(0.002)

    def remove(self, leave: bool = True) -> None:
        """Empty and delete the cgroups (with `leave`, the launcher first moves itself back out)."""
        self.kill_all(deadline_s=0.5)
        for directory in {self.memory_dir, self.pids_dir} if leave else ():
            try:
                _write(os.path.join(os.path.dirname(directory), "cgroup.procs"), str(os.getpid()))
            except OSError:
                pass
        for directory in {self.memory_dir, self.pids_dir}:
            try:
                os.rmdir(directory)
            except OSError:
                pass
