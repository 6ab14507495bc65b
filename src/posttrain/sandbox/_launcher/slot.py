"""What outlives one run in a launcher: the slot's uid, its mount point, cgroups, seccomp filters, network
namespace, and a staging area (a tmpfs private to the launcher's mount namespace, gone with the launcher) with
the jail's prepared root and the mount points of extra read-only paths.

Building these once per launcher instead of once per run is where much of the per-run cost went (measured with
perf on bubblewrap): every bind bubblewrap makes re-reads /proc/self/mountinfo, so binding /usr, /etc and /dev
one by one and remounting / and /dev read-only per run cost more than the rest of the jail's set-up, and a fresh
network namespace per run costs its set-up plus a kernel worker's tear-down. So each launcher prepares once:

* the **jail root**: a tmpfs holding /etc (copies of the few files programs need), /dev (the six device nodes,
  made with the host's numbers, and the usual links), the merged-/usr links and empty mount points (/proc,
  /tmp, /sandbox, /dev/shm), with the host's /usr bound inside; then every mount of it is made read-only (`seal`). A jail binds it as its
  `/` in one step and mounts only what is fresh per run on top (its /proc, /tmp, /dev/shm, the work dir).
  Nothing in it can be changed from a jail - every mount is read-only, and a jail can neither remount (the
  flags are locked in its user namespace, and seccomp denies mount) nor reach the staging tmpfs around it - so
  sharing it between the slot's runs shares nothing a run could write. Only the launcher changes it, between
  runs, to add the mount point of a newly requested read-only path (`stage`);
* the slot's own **network namespace**: only the loopback interface, up, reachable from nothing else, used by
  this slot's runs one after another (never two at once) and holding no state once a run's processes are dead.
Standard library only; the launcher imports this by file path.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import socket
import stat
import struct

import jail as jail_args
import syscalls

_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
              "stderr": "/proc/self/fd/2"}
_SIOCSIFFLAGS = 0x8914
_IFF_UP, _IFF_LOOPBACK, _IFF_RUNNING = 0x1, 0x8, 0x40


_PRUNED_FS = frozenset({"cgroup", "cgroup2", "devpts", "mqueue", "debugfs", "tracefs", "securityfs", "pstore",
                        "bpf", "configfs", "fusectl", "hugetlbfs", "binfmt_misc", "autofs", "efivarfs", "nsfs"})
_PER_RUN = ("proc", "tmp", "sandbox", "dev/shm")  # where bubblewrap mounts what is fresh in every run


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


_MOUNT_FLAGS = {"ro": syscalls.MS_RDONLY, "nosuid": syscalls.MS_NOSUID, "nodev": syscalls.MS_NODEV,
                "noexec": syscalls.MS_NOEXEC, "noatime": syscalls.MS_NOATIME, "nodiratime": syscalls.MS_NODIRATIME,
                "relatime": syscalls.MS_RELATIME}


def mounts() -> list[tuple[str, str, int]]:
    """(mount point, fs type, per-mount flags) of every mount in this namespace, parents before children."""
    found = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            left, _, right = line.partition(" - ")
            fields = left.split()
            flags = sum(_MOUNT_FLAGS.get(option, 0) for option in set(fields[5].split(",")))
            found.append((_unescape(fields[4]), right.split()[0], flags))
    return found


def prune_mounts(keep: list[str]) -> int:
    """Unmount, in the launcher's private mount namespace only, the pseudo file systems no jail and no launcher
    needs (other cgroup hierarchies, devpts, mqueue, debugfs ...; never a mount above a path in `keep`).
    Every jail copies and re-reads this namespace's mount table several times, so each mount costs every run."""
    removed = 0
    for point, fstype, _ in reversed(mounts()):
        if fstype in _PRUNED_FS and not any(k == point or k.startswith(point.rstrip("/") + "/") for k in keep):
            try:
                syscalls.umount(point)
                removed += 1
            except OSError:
                pass
    return removed


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
        self.root = os.path.join(self.staging, "root")  # the prepared jail root, read-only once sealed
        self.etc_dir = os.path.join(self.root, "etc")
        self.dev_dir = os.path.join(self.root, "dev")
        self.host_netns_fd = -1
        self.own_netns_fd = -1
        self.workdir_mounted = False

    def enter_own_network_namespace(self) -> None:
        """Keep a handle on the host's network namespace (for jails explicitly allowed the network) and move
        the launcher into a new one with only loopback, which its jails then share."""
        self.host_netns_fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        syscalls.unshare(syscalls.CLONE_NEWNET)
        self.own_netns_fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as handle:
            flags = _IFF_UP | _IFF_LOOPBACK | _IFF_RUNNING
            fcntl.ioctl(handle.fileno(), _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags))

    def prepare_staging(self) -> None:
        os.mkdir(self.staging, 0o711)
        syscalls.mount("posttrain-staging", self.staging, "tmpfs", syscalls.MS_NOSUID, "size=16m,mode=0711")
        os.mkdir(self.root, 0o755)
        # not nodev: it holds the jail's device nodes, made here; nothing can create others in it (read-only)
        syscalls.mount("posttrain-jail-root", self.root, "tmpfs", syscalls.MS_NOSUID, "size=16m,mode=0755")
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
        for name in _PER_RUN:
            os.makedirs(os.path.join(self.root, name), 0o755, exist_ok=True)
        os.mkdir(os.path.join(self.root, "usr"), 0o755)
        syscalls.mount("/usr", os.path.join(self.root, "usr"), None, syscalls.MS_BIND | syscalls.MS_REC)
        for name in jail_args.MERGED_USR:
            path = "/" + name
            if os.path.islink(path):
                os.symlink(os.readlink(path), os.path.join(self.root, name))
            elif os.path.isdir(path):
                os.mkdir(os.path.join(self.root, name), 0o755)
                syscalls.mount(path, os.path.join(self.root, name), None, syscalls.MS_BIND | syscalls.MS_REC)
        for name in _DEVICES:
            target = os.path.join(self.dev_dir, name)
            host = os.stat("/dev/" + name)
            try:  # a node of our own: one mount fewer for every jail to copy than a bind of the host's
                os.mknod(target, stat.S_IFCHR | 0o600, host.st_rdev)
                os.chmod(target, stat.S_IMODE(host.st_mode))  # the host's mode, whatever our umask
            except OSError:  # no CAP_MKNOD (a launcher without root): bind the host's node
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o666))
                syscalls.mount("/dev/" + name, target, None, syscalls.MS_BIND)
        for name, link in _DEV_LINKS.items():
            os.symlink(link, os.path.join(self.dev_dir, name))
        self.seal()

    def seal(self, writable: bool = False) -> None:
        """Make every mount of the jail root read-only and nosuid, and nodev but for the root's own tmpfs (its
        device nodes) and device nodes bound from the host; flags a mount already has are kept (in a user
        namespace, a launcher without root may not drop the atime flags of the host's /usr). With `writable`,
        only the root's own tmpfs becomes writable again, for the launcher to add a mount point between runs."""
        for point, _, flags in mounts():
            if point == self.root and writable:
                syscalls.remount(point, (flags | syscalls.MS_NOSUID) & ~syscalls.MS_RDONLY)
            elif writable:
                continue
            elif point == self.root or point.startswith(self.dev_dir + "/"):
                syscalls.remount(point, flags | syscalls.MS_NOSUID | syscalls.MS_RDONLY)
            elif point.startswith(self.root + "/"):
                syscalls.remount(point, flags | syscalls.MS_NOSUID | syscalls.MS_NODEV | syscalls.MS_RDONLY)

    def stage(self, path: str) -> str:
        """Bind-mount `path` (once per launcher) into the staging area, which the slot's uid can traverse, so
        bubblewrap - running as that uid - can bind it even when the way to the original is closed to it; and
        give it a mount point in the jail root unless it lies where a run mounts fresh file systems."""
        if path not in self.staged:
            target = os.path.join(self.staging, f"path{len(self.staged)}")
            is_dir = os.path.isdir(path)
            if is_dir:
                os.mkdir(target, 0o700)
            else:
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            syscalls.mount(path, target, None, syscalls.MS_BIND | syscalls.MS_REC)
            self._mount_point_in_root(path, is_dir)
            self.staged[path] = target
        return self.staged[path]

    def _mount_point_in_root(self, path: str, is_dir: bool) -> None:
        relative = os.path.normpath(path).lstrip("/")
        if any(relative == d or relative.startswith(d + "/") for d in _PER_RUN):
            return  # bubblewrap creates it in that run's own tmpfs
        inside = os.path.join(self.root, relative)
        if os.path.lexists(inside):
            return
        self.seal(writable=True)
        try:
            os.makedirs(inside if is_dir else os.path.dirname(inside), 0o755, exist_ok=True)
            if not is_dir:
                os.close(os.open(inside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        finally:
            self.seal()

    def remove_staging(self) -> None:
        for undo in (syscalls.umount, os.rmdir):  # a lazy unmount takes the staged binds with it
            try:
                undo(self.staging)
            except OSError:
                pass
