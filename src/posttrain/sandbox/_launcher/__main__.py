"""Launcher main: claim a slot uid, set up a private mount namespace and cgroups, then serve runs until EOF.

Invoked as ``python -S -E -s <this dir> CONFIG_JSON`` with the request pipe on fd 0 and the reply pipe on fd 1.
The first reply is a hello (the slot's uid, which protections it has, or why it could not start); then one
reply per request. The launcher stays single-threaded for its whole life.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import traceback

import cgroups as cgroup_mod
import runner
import seccomp
import syscalls
import wire
from slot import Slot, prune_mounts


def _claim_uid(base: int, span: int) -> tuple[int, socket.socket]:
    """The first uid in [base, base + span) no other live launcher holds. The hold is an abstract unix socket:
    the kernel releases it when this process dies, so a crash never leaks a claim (or a lock file)."""
    for uid in range(base, base + span):
        holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            holder.bind(f"\0posttrain-sandbox-uid-{uid}")
            return uid, holder
        except OSError:
            holder.close()
    raise RuntimeError(f"all {span} sandbox uids from {base} are held by other launchers")


def _close_on_exec_everywhere() -> None:
    """Mark every descriptor above stderr close-on-exec: bubblewrap is spawned without a fork in which to close
    what it should not inherit, and every descriptor the launcher opens later is close-on-exec already."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass  # the directory's own descriptor, closed by now


def _start(config: dict) -> tuple[Slot, object]:
    as_root = os.geteuid() == 0
    _close_on_exec_everywhere()
    holder = None
    if as_root:
        uid, holder = _claim_uid(int(config["uid_base"]), int(config["uid_span"]))
        gid = uid
        os.setgroups([])  # bubblewrap is spawned with the launcher's groups (spawn.py): none
    else:  # without root there is one uid to run as: our own (bubblewrap still maps it into a user namespace)
        uid, gid = os.getuid(), os.getgid()
    # Unique per launcher, so nobody else's clean-up can ever touch this launcher's cgroups.
    name = f"posttrain-sandbox-{uid}-{os.getpid()}"
    syscalls.prctl(syscalls.PR_SET_CHILD_SUBREAPER, 1)
    mount_point = tempfile.mkdtemp(prefix="posttrain-sandbox-", dir=config["tmp_dir"])
    try:
        syscalls.enter_private_mount_namespace(as_root)
    except OSError:
        os.rmdir(mount_point)
        raise
    if as_root:  # we hold the uid: any cgroup still named after it belongs to a launcher that died
        cgroup_mod.remove_stale(f"posttrain-sandbox-{uid}-")
    slot_cgroups = cgroup_mod.SlotCgroups.open(name)
    if slot_cgroups is not None:
        try:
            with open("/proc/self/oom_score_adj", "w") as handle:
                handle.write("-1000")  # a run's memory bomb must kill the run, never the launcher
        except OSError:
            pass
        slot_cgroups.join()
    filters = {allow: seccomp.build(allow_namespaces=allow) for allow in (False, True)}
    slot = Slot(uid, gid, as_root, mount_point, config["bwrap"], slot_cgroups, filters)
    slot.prepare_staging()
    prune_mounts(keep=[slot.cgroups.memory_dir, slot.cgroups.pids_dir] if slot.cgroups is not None else [])
    slot.enter_own_network_namespace()
    return slot, holder


def _cleanup(slot: Slot) -> None:
    slot.remove_staging()
    if slot.cgroups is not None:
        slot.cgroups.remove()
    try:
        os.rmdir(slot.mount_point)
    except OSError:
        pass


def main() -> int:
    config = json.loads(sys.argv[1])
    try:
        slot, _holder = _start(config)
    except Exception as error:  # noqa: BLE001 - reported to the trainer, which decides what to raise
        wire.send(1, {"ok": False, "error": f"{type(error).__name__}: {error}"})
        return 1
    wire.send(1, {
        "ok": True, "pid": os.getpid(), "uid": slot.uid, "gid": slot.gid, "root": slot.as_root,
        "cgroups": slot.cgroups.version if slot.cgroups is not None else 0,
        "seccomp": slot.seccomp[False] is not None, "mount_point": slot.mount_point,
        "cgroup_dirs": sorted({slot.cgroups.memory_dir, slot.cgroups.pids_dir}) if slot.cgroups else [],
    })
    try:
        while True:
            request = wire.recv(0)
            if request is None:
                return 0
            try:
                response = runner.run(slot, request, control_fd=0)
            except Exception:  # noqa: BLE001 - the run failed in the launcher: infrastructure, not the program
                response = {"status": "infra_error", "error": traceback.format_exc(limit=4)}
                runner._reap_all(slot.cgroups)
            wire.send(1, response)
            runner.release(slot)
            if response.get("parent_gone") or response.get("clean") is False:
                return 0  # a slot that could not be emptied is not reused: the trainer starts a fresh one
    except (BrokenPipeError, ConnectionResetError):
        return 0
    finally:
        _cleanup(slot)


if __name__ == "__main__":
    sys.exit(main())
