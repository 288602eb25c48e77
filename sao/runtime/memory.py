"""What a run holds in memory, read from the kernel and from the C allocator,
and the allocator's freed memory given back.

Readings (Linux; elsewhere they are absent):

- ``memory/rss_gib``: resident memory of this process and its children now
  (``VmRSS`` of ``/proc/PID/status`` for this process, summed over the process
  tree with each child's proportional share, ``Pss``: launched inference
  servers, Ray's processes and sandboxes count, as they do against a machine's
  RAM, and pages several of them map, such as Ray's object store, count once).
- ``memory/peak_gib``: the highest such sum this run has read, with this
  process's own high-water mark (``VmHWM``, which the kernel keeps between
  readings, reset when the meter starts: a process that held more before the
  run, such as a test worker, does not count that) in place of its current figure.
- ``memory/page_faults_m``: minor page faults of this process so far, in millions
  (``ru_minflt``): each is a page touched for the first time, or again after it
  was given back; the cost side of giving freed memory back.
- ``memory/heap_live_gib``: glibc malloc's own account (``mallinfo2``, all
  arenas) of the bytes handed out and not yet freed: torch's CPU tensors are
  malloc'd, so this is what the run's tensors (and Python's larger objects) hold.
  What is resident beyond it is the runtime's code and mapped files, and memory
  freed but kept by the allocator.

Why the allocator gives memory back after every trainer step
(:func:`give_back_freed`): glibc serves a request below its mmap threshold from
per-thread arenas, and it raises that threshold to the size of every mmapped
block freed (up to 32 MiB on 64-bit), so after the first large tensor is freed
almost every tensor of a training step (activations, gradients, logits chunks)
comes from the arenas. A freed chunk there goes back to the kernel only when it
sits at the top of its heap; the rest stays resident, fragmented among live
chunks, and each thread that allocates (the trainer's worker thread, the
engine's thread, OpenMP workers) can hold its own arena. ``malloc_trim(0)``
returns every whole free page of every arena (``madvise(MADV_DONTNEED)``), live
chunks untouched; measured numbers are in BENCHMARKS.md ("A run's memory").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import resource
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "ESTIMATE_FILE_ENV",
    "MEMORY_BUSY_EXIT",
    "RESERVED_ENV",
    "MemoryMeter",
    "give_back_freed",
    "heap_live",
    "process_tree_rss",
    "publish_expected_peak",
    "reserved_bytes",
]

GIB = float(2**30)

# How `sao experiment --jobs N` keeps runs that would not fit together apart: each
# run writes its expected peak (host bytes) to the file ESTIMATE_FILE_ENV names; a
# run started beside others gets in RESERVED_ENV the bytes they will still claim
# (expected peak minus what they hold now), and a run that would fit alone but
# not beside them exits with MEMORY_BUSY_EXIT; the runner starts it again when
# one of them ends.
ESTIMATE_FILE_ENV = "SAO_EXPECTED_PEAK_FILE"
RESERVED_ENV = "SAO_MEMORY_RESERVED"
MEMORY_BUSY_EXIT = 75  # EX_TEMPFAIL: try again later


def reserved_bytes() -> float:
    """The host memory the runs beside this one will still claim (RESERVED_ENV)."""
    return float(os.environ.get(RESERVED_ENV) or 0)


def publish_expected_peak(total_bytes: float | None) -> None:
    """Write this run's expected peak host memory (None: unknown) where
    ESTIMATE_FILE_ENV says, written then renamed; nothing when it is unset."""
    path = os.environ.get(ESTIMATE_FILE_ENV)
    if not path:
        return
    tmp = Path(path + ".tmp")
    tmp.write_text("unknown" if total_bytes is None else str(int(total_bytes)))
    tmp.replace(path)


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33+): every field a ``size_t``."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",  # bytes obtained with sbrk / arena heaps (non-mmapped)
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",  # bytes in mmapped blocks (each one live)
            "usmblks",
            "fsmblks",
            "uordblks",  # bytes in use in the arenas
            "fordblks",  # bytes free in the arenas (resident or given back)
            "keepcost",
        )
    ]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library when it is glibc with ``mallinfo2`` and ``malloc_trim``; else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return None
    return libc


def heap_live() -> int | None:
    """Bytes malloc has handed out and not had back (arenas + mmapped blocks); None
    where that cannot be read."""
    libc = _libc()
    if libc is None:
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def give_back_freed() -> None:
    """Return the allocator's free pages to the kernel (``malloc_trim(0)``): after a
    trainer step, before the next step's tensors are allocated. Live memory is
    untouched; without glibc this does nothing."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _status_kib(pid: int | str, field: str) -> int:
    """One ``kB`` field of ``/proc/PID/status`` (0 when the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (``/proc/PID/task/*/children``)."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def resident_bytes(pid: int | str) -> int:
    """``pid``'s resident memory (``VmRSS``; 0 when the process is gone)."""
    return _status_kib(pid, "VmRSS") * 1024


def proportional_bytes(pid: int) -> int:
    """``pid``'s proportional set size (``Pss`` of ``/proc/PID/smaps_rollup``: a
    page n processes map counts 1/n in each), or its ``VmRSS`` where that cannot
    be read (0 when the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return resident_bytes(pid)
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return resident_bytes(pid)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, and so on)."""
    seen, todo, out = {pid}, _children(pid), []
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        out.append(p)
        todo += _children(p)
    return out


def process_tree_rss(pid: int | None = None) -> tuple[int, int]:
    """Resident bytes of ``pid``'s descendants (not ``pid`` itself), and of ``pid``.
    The descendants' are their proportional shares: pages they map together
    (Ray's object store, which rank 0 writes an update into and every rollout
    worker maps; shared libraries) count once, not once a process."""
    root = os.getpid() if pid is None else pid
    return sum(proportional_bytes(p) for p in descendants(root)), resident_bytes(root)


def _reset_high_water_mark() -> bool:
    """Reset this process's ``VmHWM`` to its current resident memory (Linux 4.0+:
    ``5`` written to ``/proc/self/clear_refs``); False where that is refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class MemoryMeter:
    """The run's memory readings (module docstring), with the peak kept across
    readings from the meter's start; ``read()`` is cheap (a few ``/proc`` files).
    Where the high-water mark cannot be reset, the peak is the readings' alone."""

    def __init__(self, read_rss: Callable[[], tuple[int, int]] = process_tree_rss) -> None:
        self.read_rss = read_rss
        self.peak = 0
        self.supported = Path("/proc/self/status").exists()
        self.hwm = self.supported and _reset_high_water_mark()
        self.expected_gib: float | None = None
        """The peak the estimate before training gave (GiB), for the run's summary."""

    def read(self) -> dict[str, float]:
        """``memory/*`` metrics now (empty where ``/proc`` is absent)."""
        if not self.supported:
            return {}
        children, own = self.read_rss()
        hwm = _status_kib("self", "VmHWM") * 1024 if self.hwm else 0
        self.peak = max(self.peak, children + max(own, hwm))
        out = {"memory/rss_gib": (children + own) / GIB, "memory/peak_gib": self.peak / GIB}
        out["memory/page_faults_m"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt / 1e6
        live = heap_live()
        if live is not None:
            out["memory/heap_live_gib"] = live / GIB
        return out
