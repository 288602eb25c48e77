"""The supervisor's configuration for one :func:`sao.envs.sandbox.run_python`
or :func:`sao.envs.sandbox.run_shell` call: the program, the sandbox uid, the
limits, the paths the minimal root shows, the memory cgroup to make and
whether a seccomp filter exists for this machine."""

from __future__ import annotations

import os
import platform
import secrets
import site
import sys
import sysconfig
from pathlib import Path

from sao.envs.sandbox.limits import memory_cgroup_parent, seccomp_program

__all__ = ["needed_paths", "supervisor_config"]

_UID_BASE = 2_000_000_000
"""Sandbox uids are drawn from [_UID_BASE, _UID_BASE + 2**24): one fresh uid
per run, so the process limit and the clean-up cover exactly that run."""
_NOFILE = 256
"""Open files per process: also bounds what ``memfd`` and pipes can hold
where no cgroup does (each file is capped by ``file_size_mb``)."""
_SYSTEM_PATHS = (
    "/bin", "/lib", "/lib32", "/lib64", "/libx32", "/usr/bin", "/usr/lib", "/usr/lib32",
    "/usr/lib64", "/usr/libexec", "/etc/ld.so.cache",
)  # fmt: skip
"""System directories shown (read-only) in the minimal root: shared libraries
the interpreter and extension modules load, and ``/bin/sh`` for ``os.system``."""


def needed_paths() -> list[str]:
    """Paths the program's interpreter must be able to read: the interpreter,
    its prefixes, standard library and site-packages, and the system library
    directories (``_SYSTEM_PATHS``)."""
    paths = {sys.executable, os.path.realpath(sys.executable), sys.prefix, sys.base_prefix}
    paths.update((sys.exec_prefix, sys.base_exec_prefix))
    paths.update(p for p in site.getsitepackages() if os.path.isdir(p))
    stdlib = sysconfig.get_paths().get("stdlib")
    if stdlib:
        paths.add(stdlib)
    paths.update(p for p in _SYSTEM_PATHS if os.path.lexists(p))
    return sorted(paths)


def _user_threads(uid: int) -> int:
    """Threads currently owned by ``uid`` (``RLIMIT_NPROC`` counts them all)."""
    count = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def supervisor_config(
    code_dir: Path,
    *,
    cpu_s: int,
    memory_mb: int,
    file_size_mb: int,
    max_processes: int,
    disk_mb: int,
    namespaces: bool,
    allow_root: bool,
    command: str | None = None,
    max_files: int | None = None,
) -> dict[str, object]:
    """The supervisor's JSON configuration for one run: ``python -I main.py``,
    or with ``command`` ``/bin/sh -c command`` whose working directory is
    copied back to ``code_dir / "out"`` afterwards (at most ``max_files``
    files and directories, also the most its working directory may hold)."""
    work = code_dir / "work"
    uid = _UID_BASE + secrets.randbelow(1 << 24)
    nproc = max_processes if os.geteuid() == 0 else _user_threads(os.getuid()) + max_processes
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(work),
        "TMPDIR": str(work),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    if command is not None:  # the sandbox's interpreter is `python`; no .pyc files written back
        env["PATH"] = f"{os.path.dirname(sys.executable)}:{env['PATH']}"
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    program = {"kind": "python"} if command is None else {"kind": "shell", "command": command}
    return {
        "program": program,
        "export": None if command is None else str(code_dir / "out"),
        "max_files": max_files,
        "python": sys.executable,
        "work": str(work),
        "root": str(code_dir / "root"),
        "report": str(code_dir / "report.json"),
        "uid": uid,
        "parent_pid": os.getpid(),
        "needed_paths": needed_paths(),
        "disk_mb": disk_mb,
        "namespaces": namespaces,
        "allow_root": allow_root,
        "seccomp": seccomp_program(platform.machine(), deny_memory=True) is not None,
        "cgroup": {"parent": memory_cgroup_parent(), "limit": (memory_mb + 2 * disk_mb) << 20},
        "env": env,
        "limits": {
            "cpu": cpu_s,
            "as": memory_mb << 20,
            "fsize": file_size_mb << 20,
            "nproc": nproc,
            "nofile": _NOFILE,
        },
    }
