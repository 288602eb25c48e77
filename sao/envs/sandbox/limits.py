"""Limits for the sandboxed program, standard library only: a memory cgroup
(real memory, not address space), a seccomp filter and resource limits.

The supervisor (``supervisor.py``, run as a script) imports this
file as a sibling module; :mod:`sao.envs.sandbox` imports
:func:`memory_cgroup_parent` from it to find where a cgroup can be made.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import time

__all__ = ["MemoryCgroup", "apply_rlimits", "install_seccomp", "memory_cgroup_parent"]

_libc = ctypes.CDLL(None, use_errno=True)


# ---------------------------------------------------------------- cgroups


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, fstype, super options) for each mount of this process."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            head, _, tail = line.partition(" - ")
            fields, rest = head.split(), tail.split()
            if len(fields) >= 5 and len(rest) >= 3:
                point = fields[4].encode().decode("unicode_escape")
                found.append((fields[3], point, rest[0], set(rest[2].split(","))))
    return found


def _under(point: str, root: str, path: str) -> str | None:
    """Where cgroup ``path`` lies below a hierarchy mounted at ``point``
    (showing the hierarchy's ``root``), or None when that mount does not show it."""
    if root != "/" and path != root and not path.startswith(root.rstrip("/") + "/"):
        return None
    rel = path[len(root) :] if root != "/" else path
    return point.rstrip("/") + "/" + rel.lstrip("/")


def memory_cgroup_parent() -> str | None:
    """A cgroup directory under which this process can create a child with a
    memory limit, or None: cgroup v2 where this process's cgroup delegates the
    ``memory`` controller, else the cgroup v1 ``memory`` hierarchy."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            lines = [ln.rstrip("\n").split(":", 2) for ln in f if ln.count(":") >= 2]
        mounts = _mounts()
    except OSError:
        return None
    for _, controllers, path in lines:
        v2 = controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        for root, point, fstype, opts in mounts:
            if fstype != ("cgroup2" if v2 else "cgroup") or not (v2 or "memory" in opts):
                continue
            where = _under(point, root, path)
            if where and _can_limit(where, v2):
                return where
    return None


def _can_limit(where: str, v2: bool) -> bool:
    if not os.access(where, os.W_OK | os.X_OK):
        return False
    if not v2:
        return os.path.exists(os.path.join(where, "memory.limit_in_bytes"))
    try:
        with open(os.path.join(where, "cgroup.subtree_control"), encoding="utf-8") as f:
            return "memory" in f.read().split()
    except OSError:
        return False


class MemoryCgroup:
    """A child cgroup that bounds the real memory (RAM and swap: heap, shared
    memory, ``memfd`` and tmpfs pages, kernel buffers) of the processes in it.

    It is handled only through directory descriptors opened here, so that it
    still works after the supervisor enters a mount namespace whose mounts are
    read-only or hidden.
    """

    def __init__(self, parent: str, name: str, limit_bytes: int) -> None:
        self._parent = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.name = name
        os.mkdir(name, 0o755, dir_fd=self._parent)
        self._dir = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._parent)
        self.v2 = _exists(self._dir, "memory.max")
        if self.v2:
            self._write("memory.max", limit_bytes)
            self._write("memory.swap.max", 0, required=False)
            self._write("memory.oom.group", 1, required=False)
        else:
            self._write("memory.limit_in_bytes", limit_bytes)
            self._write("memory.memsw.limit_in_bytes", limit_bytes, required=False)
        self._procs = os.open("cgroup.procs", os.O_WRONLY | os.O_CLOEXEC, dir_fd=self._dir)

    def _write(self, name: str, value: int, *, required: bool = True) -> None:
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=self._dir)
            try:
                os.write(fd, str(value).encode())
            finally:
                os.close(fd)
        except OSError:
            if required:
                raise

    def join(self) -> None:
        """Move the calling process into the cgroup (its children follow)."""
        os.write(self._procs, b"0")

    def oom_kills(self) -> int:
        """Processes the kernel killed in this cgroup for going over the limit."""
        name = "memory.events" if self.v2 else "memory.oom_control"
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self._dir)
            with os.fdopen(fd, encoding="utf-8") as f:
                fields = dict(ln.split() for ln in f if len(ln.split()) == 2)
        except OSError:
            return 0
        return int(fields.get("oom_kill", 0))

    def remove(self, timeout_s: float = 2.0) -> bool:
        """Delete the cgroup once it is empty; True when it is gone."""
        for fd in (self._procs, self._dir):
            os.close(fd)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                os.rmdir(self.name, dir_fd=self._parent)
                break
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        gone = not _exists(self._parent, self.name)
        os.close(self._parent)
        return gone


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd)
    except OSError:
        return False
    return True


# ---------------------------------------------------------------- seccomp

_CLONE_NEWUSER = 0x10000000
_X32_BIT = 0x40000000
_ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        {"clone": 56, "unshare": 272, "setns": 308, "clone3": 435, "memfd_create": 319,
         "shmget": 29, "io_uring_setup": 425},
    ),
    "aarch64": (
        0xC00000B7,
        {"clone": 220, "unshare": 97, "setns": 268, "clone3": 435, "memfd_create": 279,
         "shmget": 194, "io_uring_setup": 425},
    ),
}  # fmt: skip
"""AUDIT_ARCH value and system-call numbers (linux/audit.h, asm/unistd.h)."""
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


class _Insn(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]


def seccomp_program(machine: str, deny_memory: bool) -> list[tuple[int, int, int, int]] | None:
    """The classic-BPF seccomp filter, as (code, jt, jf, k) rows, or None on
    an architecture it does not know.

    It kills the process on a foreign system-call ABI (the 32-bit entry
    point, whose numbers differ) and fails x32 calls with ENOSYS (both would
    dodge the numbers below); fails ``clone3`` with
    ENOSYS (its flags sit in memory a filter cannot read; the C library then
    falls back to ``clone``); refuses ``setns``, ``io_uring_setup`` and any
    ``clone``/``unshare`` asking for ``CLONE_NEWUSER`` with EPERM; and, when
    ``deny_memory`` (no cgroup bounds real memory), ``memfd_create`` and
    ``shmget`` too, whose pages no address-space limit counts.
    """
    if machine not in _ARCHES:
        return None
    arch, nr = _ARCHES[machine]
    eperm, enosys = _ERRNO | errno.EPERM, _ERRNO | errno.ENOSYS
    rows = [(_LD_W_ABS, 0, 0, 4), (_JEQ, 1, 0, arch), (_RET, 0, 0, _KILL_PROCESS)]
    rows.append((_LD_W_ABS, 0, 0, 0))
    if machine == "x86_64":
        rows += [(_JGE, 0, 1, _X32_BIT), (_RET, 0, 0, enosys)]
    refused = [("clone3", enosys), ("setns", eperm), ("io_uring_setup", eperm)]
    if deny_memory:
        refused += [("memfd_create", eperm), ("shmget", eperm)]
    for name, action in refused:
        rows += [(_JEQ, 0, 1, nr[name]), (_RET, 0, 0, action)]
    rows += [
        (_JEQ, 1, 0, nr["unshare"]),
        (_JEQ, 0, 3, nr["clone"]),
        (_LD_W_ABS, 0, 0, 16),  # low half of args[0], the flags of both calls
        (_JSET, 0, 1, _CLONE_NEWUSER),
        (_RET, 0, 0, eperm),
        (_RET, 0, 0, _ALLOW),
    ]
    return rows


def install_seccomp(deny_memory: bool) -> bool:
    """Set ``no_new_privs`` and install :func:`seccomp_program` for this
    process and everything it starts; False where unsupported."""
    rows = seccomp_program(platform.machine(), deny_memory)
    if rows is None:
        return False
    insns = (_Insn * len(rows))(*(_Insn(*row) for row in rows))
    prog = _Prog(len(rows), insns)
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    ret = _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0)
    return bool(ret == 0)


# ---------------------------------------------------------------- rlimits


def apply_rlimits(limits: dict[str, int]) -> None:
    """Set the program's resource limits (soft = hard, CPU with one second of
    grace between SIGXCPU and SIGKILL)."""
    for res, value in (
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NOFILE, limits["nofile"]),
        (resource.RLIMIT_NPROC, limits["nproc"]),
        (resource.RLIMIT_FSIZE, limits["fsize"]),
        (resource.RLIMIT_CPU, limits["cpu"]),
        (resource.RLIMIT_AS, limits["as"]),
    ):
        hard = value + 1 if res == resource.RLIMIT_CPU else value
        resource.setrlimit(res, (value, hard))
