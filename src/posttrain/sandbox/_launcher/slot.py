"""What outlives one run in a launcher: the slot's uid, its mount point, cgroups, seccomp filters, network
namespace, and a staging area (a tmpfs private to the launcher's mount namespace, gone with the launcher) with
the jail's /etc, /dev and the mount points of extra read-only paths.

Building these once per launcher instead of once per run is where much of the per-run cost went (measured with
perf on bubblewrap): binding /etc files and device nodes one by one makes bubblewrap re-read
/proc/self/mountinfo for each, and a fresh network namespace per run costs its set-up plus a kernel worker's
tear-down. The jail instead binds one /etc and one /dev, and joins the slot's own network namespace: only the
loopback interface, up, reachable from nothing else, used by this slot's runs one after another (never two at
once) and holding no state once a run's processes are dead.
Standard library only; the launcher imports this by file path.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct

import jail as jail_args
import syscalls

_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
              "stderr": "/proc/self/fd/2"}
_SIOCSIFFLAGS = 0x8914
_IFF_UP, _IFF_LOOPBACK, _IFF_RUNNING = 0x1, 0x8, 0x40


class Slot:
    def __init__(self, uid: int, gid: int, as_root: bool, mount_point: str, bwrap: str, cgroups, seccomp):
        self.uid = uid
        self.gid = gid
        self.as_root = as_root
        self.mount_point = mount_point
        self.bwrap = bwrap
        self.cgroups = cgroups
        self.seccomp = seccomp  # {allow_namespaces: filter bytes or None}
        self.staged: dict[str, str] = {}  # read-only path -> where it is bind-mounted for bubblewrap
        self.staging = mount_point + "-ro"
        self.etc_dir = os.path.join(self.staging, "etc")
        self.dev_dir = os.path.join(self.staging, "dev")
        self.host_netns_fd = -1

    def enter_own_network_namespace(self) -> None:
        """Keep a handle on the host's network namespace (for jails explicitly allowed the network) and move
        the launcher into a new one with only loopback, which its jails then share."""
        self.host_netns_fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        syscalls.unshare(syscalls.CLONE_NEWNET)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as handle:
            flags = _IFF_UP | _IFF_LOOPBACK | _IFF_RUNNING
            fcntl.ioctl(handle.fileno(), _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags))

    def prepare_staging(self) -> None:
        os.mkdir(self.staging, 0o711)
        syscalls.mount("posttrain-staging", self.staging, "tmpfs", syscalls.MS_NOSUID, "size=16m,mode=0711")
        os.mkdir(self.etc_dir, 0o755)
        for name in jail_args.etc_entries():
            source, target = os.path.join("/etc", name), os.path.join(self.etc_dir, name)
            try:
                os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
                if os.path.isdir(source) and not os.path.islink(source):
                    shutil.copytree(source, target, symlinks=True)
                elif os.path.lexists(source):
                    shutil.copy2(source, target, follow_symlinks=False)
            except OSError:
                pass  # unreadable or vanished: the jail simply lacks it
        os.mkdir(self.dev_dir, 0o755)
        os.mkdir(os.path.join(self.dev_dir, "shm"), 0o755)
        for name in _DEVICES:
            target = os.path.join(self.dev_dir, name)
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o666))
            syscalls.mount("/dev/" + name, target, None, syscalls.MS_BIND)
        for name, link in _DEV_LINKS.items():
            os.symlink(link, os.path.join(self.dev_dir, name))

    def stage(self, path: str) -> str:
        """Bind-mount `path` (once per launcher) into the staging area, which the slot's uid can traverse, so
        bubblewrap - running as that uid - can bind it even when the way to the original is closed to it."""
        if path not in self.staged:
            target = os.path.join(self.staging, f"path{len(self.staged)}")
            if os.path.isdir(path):
                os.mkdir(target, 0o700)
            else:
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            syscalls.mount(path, target, None, syscalls.MS_BIND | syscalls.MS_REC)
            self.staged[path] = target
        return self.staged[path]

    def remove_staging(self) -> None:
        for undo in (syscalls.umount, os.rmdir):  # a lazy unmount takes the staged binds with it
            try:
                undo(self.staging)
            except OSError:
                pass
