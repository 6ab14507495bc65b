"""A small seccomp deny-list for the jail, as raw classic-BPF bytes for ``bwrap --seccomp FD``.

Namespaces, a non-root uid and no capabilities already stop most of what these calls could do; the filter
closes what those leave open to a same-uid process: ``ptrace`` of bubblewrap's init (measured: it succeeds
without this), ``process_vm_*``, and kernel attack surface a test program never needs (bpf, userfaultfd,
io_uring, keyctl, perf events, mount APIs, module and kexec calls). Denied calls fail with EPERM.
The filter is only built for x86_64 (other architectures: `build` returns None and the jail runs without it).
Standard library only; the launcher imports this by file path.
"""

from __future__ import annotations

import os
import struct

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000
_EPERM = 1

# x86_64 syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl)
_DENIED_X86_64 = {
    "ptrace": 101, "syslog": 103, "personality": 135, "vhangup": 153, "pivot_root": 155, "acct": 163,
    "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "init_module": 175,
    "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212, "kexec_load": 246, "add_key": 248,
    "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298, "fanotify_init": 300,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310,
    "process_vm_writev": 311, "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "pidfd_getfd": 438, "mount_setattr": 442,
}

_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


_NAMESPACE_CALLS = {"unshare", "setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen",
                    "fsconfig", "fsmount", "fspick", "mount_setattr"}


def build(allow_namespaces: bool = False) -> bytes | None:
    """The filter program, or None where we have no syscall table for this machine. With `allow_namespaces`
    (for jails that may nest user namespaces) the namespace and mount calls are left to the kernel's checks."""
    if os.uname().machine != "x86_64":
        return None
    denied = sorted(nr for name, nr in _DENIED_X86_64.items() if not (allow_namespaces and name in _NAMESPACE_CALLS))
    program = [
        _insn(_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        _insn(_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),
        _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),  # a foreign ABI would bypass the numbers below
        _insn(_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        _insn(_JGE_K, 0, 1, _X32_SYSCALL_BIT),
        _insn(_RET_K, 0, 0, _RET_ERRNO | _EPERM),
    ]
    for index, nr in enumerate(denied):
        # jump to the shared "deny" return at the end, else fall through to the next test
        program.append(_insn(_JEQ_K, len(denied) - index, 0, nr))
    program.append(_insn(_RET_K, 0, 0, _RET_ALLOW))
    program.append(_insn(_RET_K, 0, 0, _RET_ERRNO | _EPERM))
    return b"".join(program)
