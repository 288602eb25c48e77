"""Calling environment code from the agent loop: deadlines that hold whatever
the environment does.

Every ``env.reset`` / ``env.step`` coroutine runs under :func:`call_env`,
which drives it through :class:`_Timed`: each synchronous slice of the
coroutine (the code between two awaits) is timed. An environment that blocks
the event loop (``time.sleep(30)`` inside ``async def step``) stalls every
episode while it runs, and asyncio cannot interrupt it; the call then fails
as ``timeout`` when its slice or its own time exceeds the deadline, with a
message that names the environment and says what to do. Time the loop spent
blocked by *other* environments is added to a call's deadline, so one
blocking environment cannot time out the innocent episodes it stalled. Its
class then runs in worker threads (:mod:`sao.rollout.envthread`), so it stalls
the run once, not at every call.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import time
import traceback
from collections.abc import Awaitable, Callable, Generator
from typing import Any

from sao.types import Env, FinishReason, StepResult

__all__ = [
    "EpisodeFailure",
    "LoopStalls",
    "call_env",
    "check_result",
    "describe_error",
    "finite_number",
    "invoke",
    "score_env",
    "stalls",
]

_STALL_S = 0.05
"""Synchronous slices at least this long count as stalls of the event loop."""


class EpisodeFailure(Exception):
    """An episode cannot go on; it ends with ``reason`` and ``message``."""

    def __init__(self, reason: FinishReason, message: str) -> None:
        super().__init__(message)
        self.reason: FinishReason = reason
        self.message = message


class LoopStalls:
    """Seconds environment code held the event loop (slices >= 50 ms), in total
    and the longest single slice since :meth:`take_max` was last called."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self.max_s = 0.0

    def add(self, seconds: float) -> None:
        if seconds >= _STALL_S:
            self.total_s += seconds
            self.max_s = max(self.max_s, seconds)

    def take_max(self) -> float:
        """The longest slice since the last call (then reset)."""
        out, self.max_s = self.max_s, 0.0
        return out


stalls = LoopStalls()
"""This process's record (one event loop per process runs the episodes)."""


def describe_error(err: BaseException) -> str:
    """``Type: message (at file:line)`` of the innermost frame that raised."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


class _Timed:
    """Awaits ``inner`` while timing each of its synchronous slices; ``on_stall``
    is told of each stall as soon as it ends."""

    def __init__(
        self, inner: Awaitable[Any], on_stall: Callable[[float], None] | None = None
    ) -> None:
        self._it = inner.__await__()
        self._on_stall = on_stall
        self.longest_s = 0.0
        self.stalled_s = 0.0

    def _record(self, t0: float) -> None:
        seconds = time.perf_counter() - t0
        self.longest_s = max(self.longest_s, seconds)
        if seconds >= _STALL_S:
            self.stalled_s += seconds
            if self._on_stall is not None:
                self._on_stall(seconds)
        stalls.add(seconds)

    def __await__(self) -> Generator[Any, Any, Any]:
        it: Any = self._it
        value: Any = None
        error: BaseException | None = None
        while True:
            t0 = time.perf_counter()
            try:
                yielded = it.send(value) if error is None else it.throw(error)
            except StopIteration as stop:
                self._record(t0)
                return stop.value
            except BaseException:
                self._record(t0)
                raise
            self._record(t0)
            try:
                value, error = (yield yielded), None
            except BaseException as err:  # e.g. the CancelledError of task.cancel()
                value, error = None, err


async def _drive(timed: _Timed) -> Any:
    return await timed


def _retrieve(task: asyncio.Future[object]) -> None:
    """Consume a cancelled env task's outcome so asyncio does not warn."""
    if not task.cancelled():
        task.exception()


def invoke(call: Callable[..., object], where: str, *args: object) -> object:
    """``call(*args)``, turning a synchronous raise into :class:`EpisodeFailure`."""
    try:
        return call(*args)
    except Exception as err:
        raise EpisodeFailure("env_error", f"{where} raised {describe_error(err)}") from err


def _blocked(where: str, seconds: float, limit: str, timeout_s: float) -> EpisodeFailure:
    return EpisodeFailure(
        "timeout",
        f"{where} blocked the event loop for {seconds:.1f} s in one go (deadline "
        f"{limit}={timeout_s} s): synchronous code inside `async def` stalls every episode. "
        "Fix: run blocking work with `await asyncio.to_thread(...)`",
    )


async def call_env(
    make: object,
    timeout_s: float,
    limit: str,
    where: str,
    owner: str = "",
    on_stall: Callable[[float], None] | None = None,
) -> object:
    """Await an env coroutine under a deadline; failures become :class:`EpisodeFailure`.
    ``owner`` names the environment (its class) in the message of a blocking one;
    ``on_stall`` is told the seconds of each synchronous slice of at least 50 ms
    (a stretch it held the event loop) as soon as the slice ends, before the
    loop runs anything else.

    Uses ``asyncio.wait`` and cancels on timeout without waiting for the
    environment to unwind (``asyncio.wait_for`` would wait, and an environment
    that swallows the cancellation would then hang the run).
    """
    if not inspect.isawaitable(make):
        raise EpisodeFailure(
            "env_error", f"{where} must be async; it returned {type(make).__name__}"
        )
    timed = _Timed(make, on_stall)
    task = asyncio.ensure_future(_drive(timed))
    start, others0 = time.perf_counter(), stalls.total_s

    def own_time() -> float:  # seconds this call has taken, less stalls it did not cause
        others = stalls.total_s - others0 - timed.stalled_s
        return time.perf_counter() - start - others

    while not task.done() and own_time() < timeout_s:
        try:
            await asyncio.wait({task}, timeout=timeout_s - own_time())
        except asyncio.CancelledError:
            task.cancel()
            raise
    if timed.longest_s > timeout_s or own_time() > timeout_s or not task.done():
        task.cancel()
        task.add_done_callback(_retrieve)
        if timed.longest_s > timeout_s:
            named = f"{where} of {owner}" if owner else where
            raise _blocked(named, timed.longest_s, limit, timeout_s)
        raise EpisodeFailure("timeout", f"{where} exceeded EpisodeLimits.{limit}={timeout_s} s")
    if task.cancelled():
        raise EpisodeFailure("env_error", f"{where} cancelled itself")
    err = task.exception()
    if isinstance(err, EpisodeFailure):  # worded already (a call run in a worker thread)
        raise err
    if err is not None:
        raise EpisodeFailure("env_error", f"{where} raised {describe_error(err)}")
    return task.result()


def check_result(result: object) -> StepResult:
    """``result`` if it is a usable :class:`StepResult`, else :class:`EpisodeFailure`."""
    if not isinstance(result, StepResult):
        raise EpisodeFailure(
            "env_error", f"Env.step returned {type(result).__name__}, not StepResult"
        )
    if not finite_number(result.reward):
        raise EpisodeFailure(
            "env_error", f"Env.step returned reward {result.reward!r}, not a number"
        )
    if not result.done and result.observation is None:
        raise EpisodeFailure(
            "env_error", "Env.step returned done=False with no observation; return one or done=True"
        )
    return result


def finite_number(value: object) -> bool:
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def score_env(env: Env) -> tuple[float, str | None]:
    """``env.score()`` as a float, or 0.0 and the reason it failed."""
    try:
        value = env.score()
    except Exception as err:
        return 0.0, f"Env.score raised {describe_error(err)}"
    if inspect.iscoroutine(value):
        value.close()
        return 0.0, "Env.score must be a plain method returning a float, not async"
    if not finite_number(value):
        return 0.0, f"Env.score returned {value!r}, not a finite number"
    return float(value), None
