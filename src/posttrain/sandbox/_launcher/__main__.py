"""Launcher main: claim a slot uid, set up a private mount namespace and cgroups, then serve runs until EOF.

Invoked as ``python -S -E -s <this dir> CONFIG_JSON`` with the request pipe on fd 0 and the reply pipe on fd 1.
The first reply is a hello (the slot's uid, which protections it has, or why it could not start); then one
reply per request. The launcher stays single-threaded for its whole life.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import stat
import sys
import tempfile
import time
import traceback

import cgroups as cgroup_mod
import runner
import seccomp
import syscalls
import wire
from slot import Slot, prune_mounts

_FRESH = ".posttrain-sandbox-new-"  # a launcher's directory until it holds its lock (and renames it)
# A fresh directory this old that nobody locks is a launcher's that died between making and locking it (its
# window is microseconds: the age keeps the sweep away from one whose launcher is about to lock it).
_FRESH_STALE_S = 60.0
_OURS = re.compile(r"posttrain-sandbox-\d+-\d+-[^/]+\Z")  # a launcher's directory (or its -ro) of this version


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
    # Unique per launcher, so nobody else's clean-up can ever touch this launcher's cgroups or directories.
    name = f"posttrain-sandbox-{uid}-{os.getpid()}"
    syscalls.prctl(syscalls.PR_SET_CHILD_SUBREAPER, 1)
    _remove_stale_directories(config["tmp_dir"])
    mount_point, _lock = _make_mount_point(config["tmp_dir"], name)  # held until this process dies
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


def _make_mount_point(tmp_dir: str, name: str) -> tuple[str, int]:
    """This launcher's directory in `tmp_dir`, ``<name>-XXXXXXXX``, and a descriptor holding an exclusive flock on
    it for the launcher's life (released by the kernel however it dies): a directory of that form nobody locks is
    a dead launcher's (`_remove_stale_directories`). Made under a name no sweep matches, locked, then renamed."""
    fresh = tempfile.mkdtemp(prefix=_FRESH, dir=tmp_dir)
    held = os.open(fresh, os.O_RDONLY | os.O_DIRECTORY)  # not inheritable: no jail ever holds it
    fcntl.flock(held, fcntl.LOCK_EX)
    final = os.path.join(tmp_dir, f"{name}-{os.path.basename(fresh)[len(_FRESH):]}")
    os.rename(fresh, final)
    return final, held


def _remove_stale_directories(tmp_dir: str) -> None:
    """The two directories each launcher killed hard left in `tmp_dir` (``posttrain-sandbox-<uid>-<pid>-X`` and
    its ``-ro``). Its mounts lived in its own mount namespace, so on the host they are empty. The trainer removes
    them when it kills a launcher itself; nobody did when the trainer died with it (a Ray worker's children are
    killed with the worker), and every such death left two more. Stale: nobody holds the directory's flock (a
    live launcher does, from any pid or mount namespace); a ``-ro`` whose directory is gone; a fresh directory
    (`_FRESH`) older than `_FRESH_STALE_S` that nobody locks. Only empty directories of our own user, never
    through a link, with rmdir: nothing with contents is ever removed."""
    try:
        names = [entry.name for entry in os.scandir(tmp_dir)
                 if _OURS.match(entry.name) or entry.name.startswith(_FRESH)]
    except OSError:
        return
    for name in sorted(names, key=lambda n: (n.endswith("-ro"), n)):  # a directory before its -ro
        path = os.path.join(tmp_dir, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue  # gone
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        if name.startswith(_FRESH) and time.time() - info.st_mtime < _FRESH_STALE_S:
            continue  # its launcher may not hold its lock yet
        owner = path[:-len("-ro")] if name.endswith("-ro") else None
        if (os.path.lexists(owner) if owner else _locked(path)):
            continue
        try:
            os.rmdir(path)
        except OSError:
            pass  # not empty, or gone: left as it is


def _locked(path: str) -> bool:
    """Whether a live launcher holds `path`'s flock (True too when it cannot be opened: left alone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


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
