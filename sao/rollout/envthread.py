"""Environments that block the event loop run in worker threads from then on.

asyncio cannot interrupt synchronous code inside ``async def`` (a
``time.sleep(30)`` in ``step``): while it runs, every episode waits.
:mod:`sao.rollout.envcall` times each stretch of environment code and fails
such a call as ``timeout``, but only once the stretch is over. So the first
time a call of an environment class holds the loop for :data:`BLOCKING_S` (or
its deadline, if that is shorter) in one go, the class is marked and named in
one warning, and from then on every ``reset`` and ``step`` of its objects runs
in a worker thread (:class:`EnvCalls`). The awaiting side keeps the deadline:
past it the episode ends as ``timeout`` at once. The abandoned call may go on
running in its thread: it is cancelled at its next ``await``, its late result
is discarded, and the thread ends when the call returns (a daemon thread, so
it never holds up the end of the run).

Each env object gets an event loop of its own in its own thread: one object is
used by one episode at a time, so its calls run one after another on that
loop, and what it made in ``reset`` (a client, a queue) still works in
``step``. Its coroutines are created in the worker thread, on the loop that
runs them. What it cannot do there is await objects bound to the main loop (a
client shared by all envs, the engine), and calls of *different* objects of a
marked class may now run at the same time, so module-level state they share
must be thread-safe.

At most :data:`MAX_ABANDONED` abandoned calls may still be running (each holds
a thread and its loop's file descriptors); past that, calls of marked classes
fail at once as ``timeout`` until some of them return.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import threading
from collections.abc import Callable, Coroutine
from functools import partial

from sao.rollout.envcall import EpisodeFailure, call_env, invoke
from sao.types import Env

__all__ = ["BLOCKING_S", "MAX_ABANDONED", "EnvCalls", "Offloaded", "offloaded"]

logger = logging.getLogger(__name__)

BLOCKING_S = 1.0
"""A call that holds the event loop this long in one go marks its env class."""

MAX_ABANDONED = 128
"""Most worker threads whose episode ended while they still run a call (each
also holds its loop's 3 file descriptors)."""

_WIND_DOWN_S = 5.0
"""Seconds a closing worker loop waits for its cancelled tasks to unwind."""


class Offloaded:
    """The env classes seen to block the event loop, and the worker threads
    whose episode has ended but whose call is still running."""

    def __init__(self) -> None:
        self.classes: set[type] = set()
        self.abandoned = 0
        self._lock = threading.Lock()

    def mark(self, cls: type, where: str, seconds: float) -> None:
        """From now on ``cls`` runs in worker threads; the first time, say so."""
        with self._lock:
            if cls in self.classes:
                return
            self.classes.add(cls)
        name = cls.__qualname__
        logger.warning(
            "%s of %s held the event loop for %.1f s in one go (synchronous code inside "
            "`async def`, e.g. time.sleep or a blocking request), stalling every episode. "
            "From now on %s.reset and .step run in a worker thread, on an event loop of each "
            "env object's own, so they cannot stall the run; their deadlines still hold (a "
            "call past one ends its episode as `timeout`). There, calls of different %s "
            "objects may run at the same time, and they cannot await objects bound to the "
            "main event loop. Fix: `await asyncio.to_thread(...)` the blocking work",
            where,
            name,
            seconds,
            name,
            name,
        )

    def left(self, delta: int) -> None:
        with self._lock:
            self.abandoned += delta

    def forget(self) -> None:
        """Unmark every class (for tests)."""
        with self._lock:
            self.classes.clear()


offloaded = Offloaded()
"""This process's record (one event loop per process runs the episodes)."""


async def _run(call: Callable[..., object], where: str, arg: object) -> object:
    """``await call(arg)``, the coroutine created here (on the worker's loop)."""
    made = invoke(call, where, arg)
    if not inspect.isawaitable(made):
        raise EpisodeFailure(
            "env_error", f"{where} must be async; it returned {type(made).__name__}"
        )
    return await made


def _settle(home: asyncio.AbstractEventLoop, out: asyncio.Future[object], task: object) -> None:
    """Hand a finished worker task's outcome to ``out`` on the caller's loop
    (runs in the worker thread); dropped when ``out`` was given up."""
    assert isinstance(task, asyncio.Task)
    if not task.cancelled():
        task.exception()  # retrieved here, so a late failure is not reported as lost

    def copy() -> None:
        if out.done():  # the call was abandoned: its late result is discarded
            return
        if task.cancelled():
            out.cancel()
        elif task.exception() is not None:
            out.set_exception(task.exception())  # type: ignore[arg-type]
        else:
            out.set_result(task.result())

    with contextlib.suppress(RuntimeError):  # the run's loop is closed: nobody waits
        home.call_soon_threadsafe(copy)


def _wind_down(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on ``loop`` (bounded wait), then close it."""
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.wait(tasks, timeout=_WIND_DOWN_S))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


class _Worker:
    """A daemon thread running an event loop of its own, for one env object."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.closed = False
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
            _wind_down(self.loop)
        finally:
            offloaded.left(-1)  # counted when the episode closed it

    def submit(
        self, make: Callable[[], Coroutine[object, object, object]]
    ) -> asyncio.Future[object]:
        """A future on the caller's loop for ``await make()`` run on this loop;
        cancelling it cancels the worker's task (at its next ``await``)."""
        home = asyncio.get_running_loop()
        out: asyncio.Future[object] = home.create_future()
        ctx = contextvars.copy_context()  # the env sees the episode's context variables
        tasks: list[asyncio.Task[object]] = []

        def start() -> None:  # on the worker's loop
            task: asyncio.Task[object] = ctx.run(self.loop.create_task, make())
            tasks.append(task)
            task.add_done_callback(partial(_settle, home, out))

        def give_up(future: asyncio.Future[object]) -> None:
            if not future.cancelled():
                return
            # `start` runs first (the loop runs callbacks in order); a closed loop
            # has cancelled its tasks already
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(lambda: [t.cancel() for t in tasks])

        self.loop.call_soon_threadsafe(start)
        out.add_done_callback(give_up)
        return out

    def close(self) -> None:
        """Stop the loop once its running call (if any) returns; the thread then ends."""
        if not self.closed:
            self.closed = True
            offloaded.left(1)
            self.loop.call_soon_threadsafe(self.loop.stop)


class EnvCalls:
    """``reset`` / ``step`` of one env object under their deadlines: on the event
    loop, or once its class has blocked the loop, in the object's own worker
    thread (see the module docstring). :meth:`close` it when the episode ends."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.owner = type(env).__qualname__
        self._worker: _Worker | None = None

    async def reset(self, seed: int, timeout_s: float) -> object:
        return await self._call("reset", seed, timeout_s)

    async def step(self, action: str, timeout_s: float) -> object:
        return await self._call("step", action, timeout_s)

    async def _call(self, method: str, arg: object, timeout_s: float) -> object:
        where, limit, cls = f"Env.{method}", f"{method}_timeout_s", type(self.env)
        call: Callable[..., object] = getattr(self.env, method)
        named = f"{where} of {self.owner} (in a thread)"
        if cls in offloaded.classes:
            return await call_env(self._offload(call, where, arg), timeout_s, limit, named)

        def seen(stall_s: float) -> None:  # marked at once, before the loop runs on
            if stall_s >= min(timeout_s, BLOCKING_S):
                offloaded.mark(cls, where, stall_s)

        moved: list[bool] = []
        try:
            either = self._either(call, where, arg, moved)
            return await call_env(either, timeout_s, limit, where, self.owner, seen)
        except EpisodeFailure as failure:
            if not moved or failure.message.startswith(f"{where} of "):
                raise
            raise EpisodeFailure(failure.reason, named + failure.message[len(where) :]) from failure

    async def _either(
        self, call: Callable[..., object], where: str, arg: object, moved: list[bool]
    ) -> object:
        """``call(arg)`` on the loop, or in the worker thread if the class was marked
        after this call was scheduled (by a call that ran just before it)."""
        if type(self.env) in offloaded.classes:
            moved.append(True)
            return await self._offload(call, where, arg)
        return await _run(call, where, arg)

    def _offload(
        self, call: Callable[..., object], where: str, arg: object
    ) -> asyncio.Future[object]:
        return self._start(where).submit(partial(_run, call, where, arg))

    def _start(self, where: str) -> _Worker:
        if self._worker is not None:
            return self._worker
        if offloaded.abandoned >= MAX_ABANDONED:
            raise EpisodeFailure(
                "timeout",
                f"{where} of {self.owner} was not started: {offloaded.abandoned} calls of "
                "environments that block the event loop still run in worker threads past "
                f"their episodes (at most {MAX_ABANDONED}). "
                "Fix: `await asyncio.to_thread(...)` the blocking work, with a timeout",
            )
        self._worker = _Worker(f"sao-env-{self.owner}")
        return self._worker

    def close(self) -> None:
        """The episode is over: its worker thread (if any) ends once free."""
        if self._worker is not None:
            self._worker.close()
