"""The few Linux calls the standard library lacks (before Python 3.12): prctl, unshare, mount, umount2.

Standard library only (ctypes); the launcher imports this by file path.
"""

from __future__ import annotations

import ctypes
import os

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, value, 0, 0, 0), f"prctl({option})")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        _libc.mount(
            source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def remount(target: str, flags: int) -> None:
    """Change the flags of the bind mount at `target` (MS_RDONLY, MS_NOSUID ...), this mount only."""
    mount("none", target, None, MS_REMOUNT | MS_BIND | flags)


def umount(target: str) -> None:
    _check(_libc.umount2(target.encode(), MNT_DETACH), f"umount {target}")


def enter_private_mount_namespace(as_root: bool) -> None:
    """Give this process its own mount namespace, so the work-dir mounts it makes are invisible to the host
    and vanish with it. Without root, a user namespace mapping our own uid makes that possible."""
    if as_root:
        unshare(CLONE_NEWNS)
    else:
        uid, gid = os.getuid(), os.getgid()
        unshare(CLONE_NEWUSER | CLONE_NEWNS)
        with open("/proc/self/setgroups", "w") as handle:
            handle.write("deny")
        with open("/proc/self/uid_map", "w") as handle:
            handle.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as handle:
            handle.write(f"{gid} {gid} 1")
    mount("none", "/", None, MS_REC | MS_PRIVATE)
