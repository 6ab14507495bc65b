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
_LEAF_SIZE = 3  # below this many numbers, compare one by one

_NAMESPACE_CALLS = {"unshare", "setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen",
                    "fsconfig", "fsmount", "fspick", "mount_setattr"}


def _search(denied: list[int]) -> list[tuple]:
    """A binary search over the sorted `denied` numbers, as instructions whose jump targets are still names
    ("allow", "deny", or ("node", i)): a test on the midpoint sends larger numbers past the lower half's code,
    so every jump goes forward, as classic BPF requires."""
    if len(denied) <= _LEAF_SIZE:
        tests = [(_JEQ_K, "deny", None, nr) for nr in denied]
        tests[-1] = (_JEQ_K, "deny", "allow", denied[-1])  # the last miss is an allowed call
        return tests
    middle = len(denied) // 2
    lower, upper = _search(denied[:middle]), _search(denied[middle:])
    return [(_JGE_K, ("skip", len(lower)), None, denied[middle])] + lower + upper


def _assemble(program: list[tuple]) -> bytes:
    """Resolve the names of `_search`'s jumps into forward offsets; "allow" and "deny" are the last two returns."""
    allow_at, deny_at = len(program), len(program) + 1
    out = []
    for index, (code, if_true, if_false, k) in enumerate(program):

        def offset(target) -> int:
            if target is None:
                return 0  # fall through to the next instruction
            if isinstance(target, tuple):  # ("skip", n): past the next n instructions
                return target[1]
            return (allow_at if target == "allow" else deny_at) - index - 1

        out.append(_insn(code, offset(if_true), offset(if_false), k))
    out.append(_insn(_RET_K, 0, 0, _RET_ALLOW))
    out.append(_insn(_RET_K, 0, 0, _RET_ERRNO | _EPERM))
    return b"".join(out)


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    if not (0 <= jt <= 255 and 0 <= jf <= 255):
        raise ValueError("seccomp filter too long for classic BPF's 8-bit jumps")
    return struct.pack("=HBBI", code, jt, jf, k)


def build(allow_namespaces: bool = False) -> bytes | None:
    """The filter program, or None where we have no syscall table for this machine. With `allow_namespaces`
    (for jails that may nest user namespaces) the namespace and mount calls are left to the kernel's checks.

    The deny-list is searched in halves rather than compared number by number: the kernel emulates a new
    filter once for every syscall number when it is loaded (to cache which calls it always allows), and
    bubblewrap loads it twice per jail, so a chain of some 45 comparisons cost ~0.1 ms of CPU per run (perf);
    the search takes at most 8 instructions per call instead of 50."""
    if os.uname().machine != "x86_64":
        return None
    denied = sorted(nr for name, nr in _DENIED_X86_64.items() if not (allow_namespaces and name in _NAMESPACE_CALLS))
    program = [
        (_LD_W_ABS, None, None, 4),  # seccomp_data.arch
        (_JEQ_K, ("skip", 1), None, _AUDIT_ARCH_X86_64),
        (_RET_K, None, None, _RET_KILL_PROCESS),  # a foreign ABI would bypass the numbers below
        (_LD_W_ABS, None, None, 0),  # seccomp_data.nr
        (_JGE_K, "deny", None, _X32_SYSCALL_BIT),  # x32 numbers: denied
    ]
    return _assemble(program + _search(denied))
