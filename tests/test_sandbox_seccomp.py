"""The jail's seccomp program, run through a small classic-BPF interpreter for every syscall number: exactly the
deny-list fails with EPERM, everything else is allowed, x32 numbers are denied and a foreign ABI is killed.

The real filter is exercised in real jails by tests/test_sandbox_security.py (ptrace, mount, unshare); this
checks the whole table, which a jail cannot probe call by call.
"""

from __future__ import annotations

import struct

import pytest

from posttrain.sandbox._launcher import seccomp

ALLOW, ERRNO_EPERM, KILL = 0x7FFF0000, 0x00050001, 0x80000000
X86_64, I386 = 0xC000003E, 0x40000003


def execute(program: bytes, nr: int, arch: int = X86_64) -> tuple[int, int]:
    """Classic BPF as the kernel runs a seccomp filter over seccomp_data (nr at offset 0, arch at 4):
    (the returned action, the number of instructions run)."""
    data = struct.pack("=iI", nr, arch) + bytes(56)
    insns = [struct.unpack_from("=HBBI", program, offset) for offset in range(0, len(program), 8)]
    accumulator, pc = 0, 0
    for steps in range(1, len(insns) + 1):  # forward jumps only: never more steps than instructions
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            accumulator = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code in (0x15, 0x35):  # BPF_JMP | BPF_JEQ / BPF_JGE, constant operand
            taken = accumulator == k if code == 0x15 else accumulator >= k
            pc += 1 + (jt if taken else jf)
        elif code == 0x06:  # BPF_RET | BPF_K
            return k, steps
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")
    raise AssertionError("ran off the end of the program")


def run_filter(program: bytes, nr: int, arch: int = X86_64) -> int:
    return execute(program, nr, arch)[0]


@pytest.mark.parametrize("allow_namespaces", [False, True])
def test_exactly_the_deny_list_is_denied(allow_namespaces):
    program = seccomp.build(allow_namespaces=allow_namespaces)
    if program is None:
        pytest.skip("the filter is only built on x86_64")
    denied = {nr for name, nr in seccomp._DENIED_X86_64.items()
              if not (allow_namespaces and name in seccomp._NAMESPACE_CALLS)}
    for nr in range(1024):
        expected = ERRNO_EPERM if nr in denied else ALLOW
        assert run_filter(program, nr) == expected, nr
    assert run_filter(program, 0x40000000 + 1) == ERRNO_EPERM  # x32 ABI
    assert run_filter(program, 101, arch=I386) == KILL
    assert run_filter(program, 2**31 - 1) == ERRNO_EPERM  # beyond x32's base: still the x32 range
    # the mount family is denied unless nested namespaces are allowed; ptrace always
    assert (run_filter(program, 165) == ERRNO_EPERM) is (not allow_namespaces)
    assert run_filter(program, 101) == ERRNO_EPERM


def test_every_call_is_decided_in_a_few_instructions():
    program = seccomp.build()
    if program is None:
        pytest.skip("the filter is only built on x86_64")
    # a binary search: the kernel emulates the filter for every syscall number when it is loaded (twice per
    # jail), and each of the program's own calls runs it; the old linear chain took up to 50 steps
    assert max(execute(program, nr)[1] for nr in range(512)) <= 12
