"""The sandbox's seccomp filter, read by a small classic-BPF interpreter: the
decision for each system call on each architecture it supports, without
installing it (the escape tests install it for real)."""

from __future__ import annotations

import errno
import struct

import pytest

from sao.envs.sandbox.limits import _ARCHES, seccomp_program

ALLOW, KILL = 0x7FFF0000, 0x80000000
EPERM, ENOSYS = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
NEWUSER, NEWNET, CLONE_THREAD_FLAGS = 0x10000000, 0x40000000, 0x003D0F00


def evaluate(rows: list[tuple[int, int, int, int]], nr: int, arch: int, arg0: int = 0) -> int:
    """Run the filter on one ``struct seccomp_data`` (nr, arch, ip, args[6])."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    acc, pc = 0, 0
    for _ in range(len(rows)):
        code, jt, jf, k = rows[pc]
        if code == 0x20:  # ld [k]
            acc, pc = struct.unpack_from("<I", data, k)[0], pc + 1
        elif code in (0x15, 0x35, 0x45):  # jeq, jge, jset
            hit = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if hit else jf)
        elif code == 0x06:  # ret k
            return k
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")
    raise AssertionError("the filter ran off its end")


@pytest.mark.parametrize("machine", sorted(_ARCHES))
@pytest.mark.parametrize("deny_memory", [True, False])
def test_decisions(machine: str, deny_memory: bool) -> None:
    rows = seccomp_program(machine, deny_memory)
    assert rows is not None and len(rows) < 64
    arch, nr = _ARCHES[machine]
    memory = EPERM if deny_memory else ALLOW
    cases = [
        (nr["unshare"], NEWUSER, EPERM),
        (nr["unshare"], NEWUSER | NEWNET, EPERM),
        (nr["unshare"], NEWNET, ALLOW),  # then refused by the kernel: no capability
        (nr["clone"], NEWUSER | 17, EPERM),
        (nr["clone"], 17, ALLOW),  # fork
        (nr["clone"], CLONE_THREAD_FLAGS, ALLOW),  # pthread_create
        (nr["clone3"], 0, ENOSYS),
        (nr["setns"], 0, EPERM),
        (nr["io_uring_setup"], 0, EPERM),
        (nr["memfd_create"], 0, memory),
        (nr["shmget"], 0, memory),
        (0, 0, ALLOW),
        (1, 0, ALLOW),
    ]
    for call, arg0, expected in cases:
        assert evaluate(rows, call, arch, arg0) == expected, (machine, call, arg0)
    assert evaluate(rows, nr["unshare"], 0x40000003, NEWUSER) == KILL  # i386 ABI
    if machine == "x86_64":
        assert evaluate(rows, 0x40000000 | nr["unshare"], arch, NEWUSER) == ENOSYS  # x32 ABI


def test_unknown_architecture_has_no_filter() -> None:
    assert seccomp_program("sparc64", deny_memory=True) is None
