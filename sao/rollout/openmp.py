"""Give back a thread's idle OpenMP team, so the engine's decode step runs at full speed.

Torch's CPU kernels run their parallel regions on OpenMP (GNU libgomp in
the Linux wheels), and libgomp keeps one team of worker threads per thread
that ever started a parallel region, alive until that thread exits. Once
the process holds more such workers than it has CPUs, libgomp shortens
every worker's spin-wait to about a hundred iterations, and each parallel
region then waits for a sleeping worker to be woken. A batch-1 decode step
of SmolLM2-135M runs ~121 short GEMV regions, and measured 43 ms on a
second thread beside the loading thread's idle team, 28 ms once that team
was given back (``benchmarks/decode_thread.py``, BENCHMARKS.md).

So a thread that has finished its torch work and goes idle (the engine's
thread when it has nothing to decode, a worker thread after a trainer step,
the thread that built the engine) calls :func:`release_team`. The team is
built again, in about a tenth of a millisecond, by the thread's next
parallel region; what it computes does not change.

``omp_pause_resource_all`` (OpenMP 5.0) is what frees it: in libgomp it
frees the calling thread's pool. Other OpenMP runtimes give it other
meanings, so only a loaded libgomp is called; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch  # noqa: F401  (loads the libgomp its kernels use)

__all__ = ["release_team", "releasing"]

_OMP_PAUSE_SOFT = 1

P = ParamSpec("P")
R = TypeVar("R")


@functools.cache
def _libgomp_pauses() -> tuple[Callable[[int], int], ...]:
    """``omp_pause_resource_all`` of every libgomp this process has loaded."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return ()
    paths = {line.split()[-1] for line in maps.splitlines() if "/libgomp" in line}
    pauses = []
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # gone, or a libgomp older than OpenMP 5.0
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        pauses.append(fn)
    return tuple(pauses)


def release_team() -> bool:
    """Free the calling thread's idle OpenMP worker team, if libgomp made one.

    True when a libgomp was called and accepted (it refuses inside a
    parallel region). Cheap when there is no team.
    """
    pauses = _libgomp_pauses()
    return bool(pauses) and all(pause(_OMP_PAUSE_SOFT) == 0 for pause in pauses)


def releasing(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` that gives back its thread's OpenMP team when it returns or
    raises: for the torch work handed to ``asyncio.to_thread``, whose
    worker threads outlive the call."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        finally:
            release_team()

    return run
