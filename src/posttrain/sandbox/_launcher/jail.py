"""The bubblewrap command line for one run: what the jail sees and which namespaces it gets.

The jail's root is the launcher's prepared root (see slot.py), bound as `/` in one step and read-only in every
mount: the host's /usr (and its merged-/usr links), an /etc of copies of the few files programs need
(`ETC_ENTRIES`), a minimal /dev. On top, fresh per run: a new /proc for the jail's own PID namespace,
size-capped tmpfs at /tmp and /dev/shm, and the run's work dir at `WORKDIR`, read-write. Nothing else of the
host exists inside: not its home directories, not the project, not other jails.

Fewer mounts is faster: bubblewrap re-reads /proc/self/mountinfo for every bind and every read-only remount, so
binding /usr, /etc and /dev one by one and remounting / and /dev read-only per run cost more CPU (measured with
perf) than the rest of the jail's set-up together. Only a jail with ``readonly_root`` off (a test switch) is
still built the old way, on a writable tmpfs root of its own.
Standard library only; the launcher imports this by file path.
"""

from __future__ import annotations

import glob
import os

WORKDIR = "/sandbox"
PATH = "/usr/local/bin:/usr/bin:/bin"
MERGED_USR = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
ETC_ENTRIES = (
    "passwd", "group", "nsswitch.conf", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime",
    "alternatives", "os-release", "mime.types", "ssl/certs", "ca-certificates", "ca-certificates.conf",
)
INFO_FD = 3
SECCOMP_FD = 4
ARGS_FD = 5  # the launcher hands bubblewrap its options through a pipe (spawn.py says why)


def etc_entries() -> list[str]:
    return list(ETC_ENTRIES) + [os.path.relpath(p, "/etc") for p in sorted(glob.glob("/etc/python3*"))]


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in MERGED_USR:
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def bwrap_options(
    workdir_host: str, limits: dict, jail: dict, env: dict[str, str], seccomp: bool, root: str,
    staged: dict[str, str] | None = None,
) -> list[str]:
    """bubblewrap's options: its command line before ``--`` and the command. ``root`` is the launcher's prepared
    (sealed, read-only) jail root. ``staged`` maps each of ``jail["ro_paths"]`` to where the launcher
    bind-mounted it for bubblewrap, which runs as the slot's uid and may not be able to reach the original
    (e.g. under /root)."""
    # No --unshare-net: the launcher gave its slot a network namespace of its own (see slot.py), which the
    # jail inherits - or, with jail["network"], the launcher joined the host's around the spawn (spawn.py).
    args = ["--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
            "--new-session", "--hostname", "sandbox", "--info-fd", str(INFO_FD)]
    if not jail.get("nested_namespaces"):
        args.append("--disable-userns")
    if seccomp:
        args += ["--seccomp", str(SECCOMP_FD)]
    readonly = jail.get("readonly_root", True)
    if readonly:
        # --dev-bind: the device nodes inside keep working; every mount of it is already read-only, nosuid and
        # (but for the devices) nodev, so bubblewrap has nothing to remount
        args += ["--dev-bind", root, "/"]
    else:  # the weakened test layout: a writable tmpfs root of bubblewrap's own, the system bound into it
        args += _system_binds() + ["--ro-bind", os.path.join(root, "etc"), "/etc",
                                   "--dev-bind", os.path.join(root, "dev"), "/dev"]
    tmp_bytes = str(int(limits["tmp_mb"]) << 20)
    args += ["--proc", "/proc", "--size", tmp_bytes, "--tmpfs", "/tmp", "--size", tmp_bytes, "--tmpfs", "/dev/shm"]
    # After the private /tmp, so a path the caller shares from under the host's /tmp (a virtualenv there) is
    # not hidden beneath it.
    for path in jail.get("ro_paths", ()):
        args += ["--ro-bind", (staged or {}).get(path, path), path]
    args += ["--bind", workdir_host, WORKDIR, "--chdir", WORKDIR]
    args += ["--clearenv", "--setenv", "PATH", PATH, "--setenv", "HOME", WORKDIR, "--setenv", "TMPDIR", "/tmp",
             "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
    for key, value in env.items():
        args += ["--setenv", key, value]
    return args
