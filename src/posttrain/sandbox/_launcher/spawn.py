"""Starting bubblewrap without forking the launcher: `posix_spawn` (vfork + exec) as the slot's uid, with the
run's rlimits put on bubblewrap from outside before it may create the jail.

Forking the launcher - a Python process - cost 2.2 ms of CPU per run (perf, a 2-core VM): the kernel copies its
page tables, the child's Python code takes a copy-on-write fault on every page it touches, and the exec then
tears the copy down again. A vfork-style spawn copies nothing, but runs no code of ours in the child, so what the
fork's child did before exec happens another way:

* **uid and gid**: the launcher (root) sets its real and saved uid and gid to the slot's for the few
  microseconds of the spawn, keeping effective uid 0 (and so its capabilities), and spawns with ``resetids``:
  the child sets its effective ids to the real ones - the slot's, all three - and execs bubblewrap as the slot's
  uid with no capabilities, as `setresuid` in a forked child did. (The saved ids matter: a vfork parent resumes
  while its child's exec is still committing credentials, and `prlimit` below needs them final already.) No
  run of the slot is alive during that window (runs are sequential and the slot is emptied between them), and
  the launcher has no supplementary groups (dropped at start), so the child has none either.
* **rlimits and oom_score_adj**: set on bubblewrap's process with `prlimit` and /proc before it can clone the
  jail. bubblewrap reads its options from a pipe (``--args FD``) before it creates any namespace or process,
  and the launcher writes that pipe only after the limits are in place - so every process of the jail
  inherits them, as before. `prlimit` on another process needs the caller's real ids to match the target's
  (or CAP_SYS_RESOURCE, which root lacks on some machines): the same real ids as above give that. If the
  limits cannot be set, bubblewrap is killed before it has its options; if the launcher dies in between,
  bubblewrap reads no options and builds no jail: it fails at once (its command does not exist in the empty
  root it then makes).
* **signals**: SIGPIPE and SIGXFSZ, which Python ignores (and exec would pass on), are reset to the default;
* **descriptors**: only the run's, placed by the spawn's file actions; every other descriptor of the launcher
  is close-on-exec (it marks those it inherited at start);
* **network** (a test switch): the launcher joins the host's network namespace around the spawn.
Standard library only; the launcher imports this by file path.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal

import syscalls
from jail import ARGS_FD
from slot import Slot


def jail_rlimits(limits: dict) -> list[tuple[int, tuple[int, int]]]:
    """(resource, (soft, hard)) for every limit a run's processes get."""
    nproc = int(limits["processes"]) + 2  # bubblewrap's monitor and its init in the jail
    cpu = max(1, int(limits["cpu_s"] + 0.999))
    rlimits = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU at the soft limit, SIGKILL one second later
        (resource.RLIMIT_NPROC, (nproc, nproc)),
        (resource.RLIMIT_NOFILE, (max(16, int(limits["open_files"])),) * 2),
        (resource.RLIMIT_FSIZE, (int(limits["file_size_mb"]) << 20,) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if limits.get("address_space_mb"):
        rlimits.append((resource.RLIMIT_AS, (int(limits["address_space_mb"]) << 20,) * 2))
    return rlimits


def _file_actions(fds: dict[int, int]) -> list[tuple]:
    """dup2 every source fd onto its target in the child, without clobbering a source that is another's target:
    first to numbers above all of them, then into place, then close the copies (dup2 clears close-on-exec)."""
    spare = max(*fds, *fds.values()) + 1
    actions: list[tuple] = []
    for offset, source in enumerate(fds.values()):
        actions.append((os.POSIX_SPAWN_DUP2, source, spare + offset))
    for offset, target in enumerate(fds):
        actions.append((os.POSIX_SPAWN_DUP2, spare + offset, target))
    for offset in range(len(fds)):
        actions.append((os.POSIX_SPAWN_CLOSE, spare + offset))
    return actions


@contextlib.contextmanager
def _spawning_identity(slot: Slot, network: bool):
    """The launcher's ids (and, for a jail allowed the network, its network namespace) while it spawns: the
    slot's real and saved ids - see the module's docstring, and the race in docs/sandbox.md's traps."""
    entered = []
    try:
        if network:
            syscalls.setns(slot.host_netns_fd, syscalls.CLONE_NEWNET)
            entered.append("network")
        if slot.as_root:
            entered.append("ids")
            os.setresgid(slot.gid, -1, slot.gid)
            os.setresuid(slot.uid, -1, slot.uid)
        yield
    finally:
        try:
            if "ids" in entered:
                os.setresuid(0, 0, 0)
                os.setresgid(0, 0, 0)
            if "network" in entered:
                syscalls.setns(slot.own_netns_fd, syscalls.CLONE_NEWNET)
        except OSError:
            # fail closed: a launcher left in the host's network namespace or without its ids must not serve
            # another run (the trainer sees it gone, reports infra_error and starts a fresh one)
            os._exit(70)


def spawn_bubblewrap(slot: Slot, options: list[str], command: list[str], fds: dict[int, int], limits: dict,
                     network: bool) -> int:
    """Start bubblewrap with `options` (through the ``--args`` pipe) and `command` as the slot's uid with the
    run's limits, `fds` mapped (target -> source); returns its pid. Raises OSError if it could not be started
    or limited (it is killed then, before it has its options)."""
    args_r, args_w = os.pipe2(os.O_CLOEXEC)
    pid = 0
    try:
        actions = _file_actions({**fds, ARGS_FD: args_r})
        with _spawning_identity(slot, network):
            argv = [slot.bwrap, "--args", str(ARGS_FD), "--", *command]
            pid = os.posix_spawn(slot.bwrap, argv, {}, file_actions=actions, resetids=slot.as_root,
                                 setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
            for which, value in jail_rlimits(limits):
                resource.prlimit(pid, which, value)
        fd = os.open(f"/proc/{pid}/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"500")  # the run, not the launcher, is the OOM killer's first choice
        finally:
            os.close(fd)
        os.close(args_r)
        args_r = -1
        payload = memoryview(("\0".join(options) + "\0").encode("utf-8", "surrogateescape"))
        while payload:
            payload = payload[os.write(args_w, payload):]
    except BaseException:
        if pid:
            os.kill(pid, signal.SIGKILL)  # before it has all its options: it never builds the jail
            os.waitpid(pid, 0)
        raise
    finally:
        for fd in (args_r, args_w):
            if fd >= 0:
                os.close(fd)
    return pid
