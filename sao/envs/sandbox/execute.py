"""A code sandbox for environments that run model-written Python.

:func:`run_python` runs a program in a separate interpreter (``python -I``)
with resource limits, no network, a private working directory and a
wall-clock deadline, and returns a :class:`SandboxResult`; it never raises for
anything the program does. :func:`describe_isolation` says in one line what
this machine gives a run; each result's :class:`Isolation` says what it got.

* Always: its own session and process group; a supervisor process that is a
  child subreaper, so every process the program starts (even after
  ``setsid`` or a double fork) is killed and reaped when the program exits or
  the deadline passes; ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``,
  ``RLIMIT_NOFILE`` and ``RLIMIT_NPROC``; a minimal environment with ``HOME``
  and ``TMPDIR`` in the working directory, which is removed afterwards;
  output read with a cap.
* Where a memory cgroup can be made (v2 with the controller delegated, or
  v1): real memory (heap, ``memfd``, shared memory, tmpfs pages, kernel
  buffers) is bounded by ``memory_mb + 2 * disk_mb``; the kernel kills the
  program at the limit (``killed_reason="memory_limit"``).
* seccomp (x86_64, aarch64): no new user namespaces, no ``setns``, no
  ``io_uring``; without a cgroup also no ``memfd_create`` or ``shmget``.
* As root, where the kernel allows namespaces (level ``namespaces``): fresh
  pid, mount, network, IPC and UTS namespaces; the program sees only a
  minimal read-only root (interpreter, its libraries, ``/dev`` basics,
  ``/proc`` of its own pid namespace) and its size-limited tmpfs working
  directory; it runs under a fresh unprivileged uid.
* Otherwise (level ``fallback``): network calls are blocked by replacing
  ``socket.socket`` in the program's interpreter, which code that imports
  ``_socket`` directly can get around; the host's files, processes and Unix
  sockets are protected only by ordinary permissions. As root the program
  gets a fresh uid if its interpreter is reachable by other users; if not,
  it would run as root, which is refused unless ``allow_root=True``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sao.envs.sandbox.config import supervisor_config
from sao.envs.sandbox.jail import copy_tree
from sao.envs.sandbox.process import MARKERS, Capture, supervise

__all__ = ["Isolation", "SandboxResult", "describe_isolation", "run_python", "run_shell"]

_MIN_MEMORY_MB = 32


@dataclass(frozen=True)
class Isolation:
    """Which protections a run actually got."""

    namespaces: bool = False
    """True when the program ran in fresh pid, mount, network, IPC and UTS
    namespaces inside the minimal read-only root; False in fallback mode."""
    seccomp: bool = False
    """True when the seccomp filter (no new user namespaces, ...) was installed."""
    cgroup: bool = False
    """True when a memory cgroup bounded the program's real memory."""
    uid: int | None = None
    """The unprivileged uid the program ran under, or None when it kept the caller's."""
    as_root: bool = False
    """True when the program ran as root (only with ``allow_root=True``)."""

    @property
    def level(self) -> str:
        """One word for the mode and its extras, e.g. ``namespaces+seccomp+cgroup``
        or ``fallback+seccomp``; ``+as-root`` is appended when the program ran as root."""
        parts = ["namespaces" if self.namespaces else "fallback"]
        parts += [name for name, on in (("seccomp", self.seccomp), ("cgroup", self.cgroup)) if on]
        return "+".join(parts + (["as-root"] if self.as_root else []))


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one :func:`run_python` call."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The program's exit status; ``-N`` when signal ``N`` killed it; None if unknown."""
    timed_out: bool
    """True when the wall-clock deadline stopped the program."""
    killed_reason: str | None
    """Why the program was stopped or refused something, or None: ``timeout``,
    ``cpu_limit``, ``memory_limit`` (a ``MemoryError``, or the memory cgroup's
    kill), ``process_limit``, ``file_size_limit``,
    ``disk_limit``, ``output_limit``, ``leftover_processes``, ``signal:NAME``
    or ``sandbox_error``."""
    truncated: bool
    """True when stdout or stderr was cut to ``max_output_chars``."""
    duration_s: float
    leftover_processes: int = 0
    """Processes still running after the program exited, killed by the sandbox."""
    isolation: Isolation = field(default_factory=Isolation)
    pid: int = 0
    """Pid (and process-group id) of the sandbox's supervisor process."""
    export_error: str | None = None
    """:func:`run_shell` only: why the working directory's final files were not
    copied back (e.g. more than ``max_files``), or None."""

    @property
    def ok(self) -> bool:
        """True when the program exited with status 0 and was not stopped."""
        return self.exit_code == 0 and self.killed_reason is None


def _check_limits(
    wall_s: float, cpu_s: int, memory_mb: int, max_output_chars: int, sizes: dict[str, int]
) -> None:
    """Raise a ``ValueError`` naming the first limit a caller set out of range."""
    if not wall_s > 0:
        raise ValueError(f"run_python: wall_s must be > 0, got {wall_s}")
    if cpu_s < 1:
        raise ValueError(f"run_python: cpu_s must be >= 1 (whole seconds), got {cpu_s}")
    if memory_mb < _MIN_MEMORY_MB:
        raise ValueError(
            f"run_python: memory_mb must be >= {_MIN_MEMORY_MB} (the interpreter needs it), "
            f"got {memory_mb}"
        )
    if max_output_chars < 0:
        raise ValueError(f"run_python: max_output_chars must be >= 0, got {max_output_chars}")
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"run_python: {name} must be >= 1, got {value}")


async def run_python(
    code: str,
    *,
    wall_s: float = 5.0,
    cpu_s: int = 5,
    memory_mb: int = 256,
    file_size_mb: int = 1,
    max_output_chars: int = 2000,
    max_processes: int = 32,
    disk_mb: int = 16,
    flood_bytes: int = 4_000_000,
    namespaces: bool = True,
    allow_root: bool = False,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandbox and report what happened.

    ``wall_s`` is the wall-clock deadline, ``cpu_s`` the CPU-time limit,
    ``memory_mb`` the address-space limit (real memory, where a cgroup is
    available, is capped at ``memory_mb + 2 * disk_mb``), ``file_size_mb``
    the largest file the program may write, ``max_processes`` the most
    processes and threads it may have, ``disk_mb`` the size of its working
    directory and of its ``/dev/shm`` (in namespace mode). stdout and stderr
    are each cut to ``max_output_chars``; a program that writes more than
    ``flood_bytes`` in total is stopped. ``namespaces=False`` skips the
    namespaces (the fallback level described in the module docstring).
    ``allow_root=True`` lets the program run as root where the sandbox cannot
    give it an unprivileged uid; without it that case raises
    ``PermissionError`` before the program starts.
    """
    sizes = {"file_size_mb": file_size_mb, "max_processes": max_processes, "disk_mb": disk_mb}
    _check_limits(wall_s, cpu_s, memory_mb, max_output_chars, sizes)

    def seed(work: Path) -> None:
        (work / "main.py").write_bytes(code.encode("utf-8", errors="replace"))

    limits = {"cpu_s": cpu_s, "memory_mb": memory_mb, "namespaces": namespaces, **sizes}
    return await _sandboxed(
        seed, limits, wall_s, max_output_chars, flood_bytes, allow_root=allow_root
    )


async def run_shell(
    command: str,
    workdir: str | os.PathLike[str],
    *,
    wall_s: float = 5.0,
    cpu_s: int = 5,
    memory_mb: int = 256,
    file_size_mb: int = 1,
    max_output_chars: int = 2000,
    max_processes: int = 32,
    disk_mb: int = 16,
    max_files: int = 2000,
    flood_bytes: int = 4_000_000,
    namespaces: bool = True,
    allow_root: bool = False,
    write_back: bool = True,
) -> SandboxResult:
    """Run ``/bin/sh -c command`` in a fresh sandbox whose working directory
    is a copy of ``workdir`` (a persistent working copy, e.g. an agent's
    repository), with the limits and isolation of :func:`run_python`.

    The working directory (a tmpfs of ``disk_mb`` MiB holding at most
    ``max_files`` files and directories in namespace mode) starts as a copy
    of ``workdir``: directories, regular files and symbolic links as links
    (they resolve inside the sandbox). With ``write_back`` its final state,
    also after a timeout or a kill, replaces ``workdir``'s contents:
    directories and regular files only (links, fifos and other special files
    the command made are dropped); when it cannot be copied back
    (``export_error``) ``workdir`` is left as it was. The sandbox's
    interpreter is first on ``PATH`` as ``python``; bytecode is not written.
    Raises ``ValueError`` when ``workdir`` is not a directory or holds more
    than ``disk_mb`` MiB or ``max_files`` entries.
    """
    sizes = {"file_size_mb": file_size_mb, "max_processes": max_processes, "disk_mb": disk_mb}
    _check_limits(wall_s, cpu_s, memory_mb, max_output_chars, {**sizes, "max_files": max_files})
    source = Path(workdir)
    _check_workdir(source, disk_mb, max_files)

    def seed(work: Path) -> None:
        copy_tree(str(source), str(work))

    limits = {"cpu_s": cpu_s, "memory_mb": memory_mb, "namespaces": namespaces, **sizes}
    return await _sandboxed(
        seed,
        limits,
        wall_s,
        max_output_chars,
        flood_bytes,
        allow_root=allow_root,
        command=command,
        max_files=max_files,
        write_back=source if write_back else None,
    )


def _check_workdir(workdir: Path, disk_mb: int, max_files: int) -> None:
    """Raise a ``ValueError`` when ``workdir`` cannot fit the sandbox's working directory."""
    if not workdir.is_dir():
        raise ValueError(f"run_shell: workdir {str(workdir)!r} is not a directory")
    entries, size = 0, 0
    for top, dirs, files in os.walk(workdir):
        entries += len(dirs) + len(files)
        size += sum(os.lstat(os.path.join(top, f)).st_size for f in files)
    if entries > max_files:
        raise ValueError(f"run_shell: workdir holds {entries} entries, more than max_files")
    if size > disk_mb << 20:
        raise ValueError(f"run_shell: workdir holds {size} bytes, more than disk_mb={disk_mb}")


async def _sandboxed(
    seed: Callable[[Path], None],
    limits: dict[str, int | bool],
    wall_s: float,
    max_output_chars: int,
    flood_bytes: int,
    *,
    allow_root: bool,
    command: str | None = None,
    max_files: int | None = None,
    write_back: Path | None = None,
) -> SandboxResult:
    """One sandbox run: a private directory whose ``work`` folder ``seed``
    fills, the supervisor, the result; with ``write_back`` the exported
    working directory then replaces that directory's contents."""
    start = time.monotonic()
    code_dir = Path(tempfile.mkdtemp(prefix="sao-sandbox-"))
    cfg: dict[str, object] = {}
    try:
        code_dir.chmod(0o711)  # the sandbox uid may traverse, never list or write
        for name in ("work", "root", "out"):
            (code_dir / name).mkdir(mode=0o700)
        seed(code_dir / "work")
        cfg = supervisor_config(
            code_dir,
            cpu_s=int(limits["cpu_s"]),
            memory_mb=int(limits["memory_mb"]),
            file_size_mb=int(limits["file_size_mb"]),
            max_processes=int(limits["max_processes"]),
            disk_mb=int(limits["disk_mb"]),
            namespaces=bool(limits["namespaces"]),
            allow_root=allow_root,
            command=command,
            max_files=max_files,
        )
        capture = Capture(4 * max_output_chars + 4, flood_bytes)
        pid, stop_reason = await supervise(cfg, capture, wall_s)
        report = _report(code_dir)
        result = _result(capture, report, cfg, pid, stop_reason, max_output_chars, start)
        if write_back is not None and report.get("exported"):
            _replace_contents(write_back, code_dir / "out")
        return result
    finally:
        shutil.rmtree(code_dir, ignore_errors=True)
        _remove_cgroup(cfg)


def _report(code_dir: Path) -> dict[str, object]:
    """The supervisor's report, or {} when it wrote none."""
    try:
        report: dict[str, object] = json.loads((code_dir / "report.json").read_text())
    except (OSError, ValueError):
        return {}
    return report


def _replace_contents(target: Path, source: Path) -> None:
    """Make ``target``'s contents those of ``source`` (moved, not copied)."""
    for entry in os.scandir(target):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    for entry in os.scandir(source):
        shutil.move(entry.path, target / entry.name)


def _remove_cgroup(cfg: dict[str, object]) -> None:
    """Backstop for a supervisor that was killed before removing its cgroup."""
    spec = cfg.get("cgroup")
    if isinstance(spec, dict) and spec.get("parent"):
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(str(spec["parent"]), f"sao-sandbox-{cfg['uid']}"))


def describe_isolation(*, namespaces: bool = True, allow_root: bool = False) -> str:
    """One line saying what isolation :func:`run_python` gets on this machine
    with these options, found by running an empty program; meant for a run's
    start-up log. Safe to call from inside an event loop (it blocks)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        probe = run_python("pass", namespaces=namespaces, allow_root=allow_root)
        try:
            iso = pool.submit(asyncio.run, probe).result().isolation
        except PermissionError as e:
            return f"sandbox isolation: refused ({e})"
    parts = [
        "pid/mount/net/ipc/uts namespaces, minimal read-only root"
        if iso.namespaces
        else "no namespaces: host files, processes and Unix sockets visible",
        "memory cgroup" if iso.cgroup else "no memory cgroup: address-space limit only",
        "seccomp" if iso.seccomp else "no seccomp: user namespaces allowed",
        f"uid {iso.uid}" if iso.uid is not None else ("ROOT" if iso.as_root else "caller's uid"),
    ]
    return f"sandbox isolation: {iso.level} ({'; '.join(parts)})"


def _decode(buf: bytearray, limit: int, work: str) -> tuple[str, bool]:
    text = buf.decode("utf-8", errors="replace").replace(work + "/", "")
    return text[:limit], len(text) > limit


def _result(
    capture: Capture,
    report: dict[str, object],
    cfg: dict[str, object],
    pid: int,
    stop_reason: str | None,
    max_output_chars: int,
    start: float,
) -> SandboxResult:
    """Assemble the result from the captured output and the supervisor's report."""
    work = str(cfg["work"])
    stdout, cut_out = _decode(capture.data[1], max_output_chars, work)
    stderr, cut_err = _decode(capture.data[2], max_output_chars, work)
    if report.get("refused"):
        raise PermissionError(f"run_python: {report['refused']}")
    status = report.get("status")
    exit_code = None if not isinstance(status, int) else os.waitstatus_to_exitcode(status)
    reason = stop_reason or _stop_reason(exit_code, capture.reasons, report)
    if not report and reason is None:
        reason = "sandbox_error"
    isolation = Isolation(
        namespaces=bool(report.get("namespaces")),
        seccomp=bool(report.get("seccomp")),
        cgroup=bool(report.get("cgroup")),
        uid=int(str(cfg["uid"])) if report.get("drop_uid") else None,
        as_root=bool(report.get("as_root")),
    )
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        exit_code=exit_code,
        timed_out=stop_reason == "timeout",
        killed_reason=reason,
        truncated=capture.truncated or cut_out or cut_err,
        duration_s=time.monotonic() - start,
        leftover_processes=int(str(report.get("leftovers", 0))),
        isolation=isolation,
        pid=pid,
        export_error=None if report.get("export_error") is None else str(report["export_error"]),
    )


def _stop_reason(exit_code: int | None, reasons: set[str], report: dict[str, object]) -> str | None:
    """Name the limit that stopped the program, from its status and the
    limits its stderr mentions."""
    if report.get("oom_kills") and exit_code != 0:  # the cgroup killed it or a child
        return "memory_limit"
    if exit_code is not None and exit_code < 0:
        sig = -exit_code
        if sig in (signal.SIGXCPU, signal.SIGKILL):
            return "cpu_limit"
        return f"signal:{signal.Signals(sig).name}" if sig in signal.valid_signals() else "signal"
    if exit_code not in (None, 0):
        for _, reason in MARKERS:
            if reason in reasons:
                return reason
    if report.get("leftovers"):
        return "leftover_processes"
    return None
