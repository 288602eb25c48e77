"""An environment whose ``async def step`` blocks the event loop stalls the run
once: its class then runs in worker threads (:mod:`sao.rollout.envthread`),
where the deadline holds in time and the rest of the run keeps moving."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from sao.envs.base import Split
from sao.rollout import EpisodeLimits, envthread, run_episode
from sao.rollout.engine import episode_key
from sao.rollout.envthread import offloaded
from sao.runtime.buffer import TrajectoryBuffer
from sao.runtime.orchestrator import Orchestrator
from sao.runtime.runner import LocalRunner
from sao.runtime.staleness import StalenessGate
from sao.types import Env, SamplingParams, StepResult, Trajectory
from tests.rollout.conftest import c
from tests.rollout.scripted import Reply, ScriptedEngine, done

SAMPLING = SamplingParams(max_new_tokens=8)
WARNINGS = "sao.rollout.envthread"


def limits(**kw: object) -> EpisodeLimits:
    base: dict[str, object] = {"max_turns": 2, "max_total_tokens": 512}
    return EpisodeLimits(**(base | kw))  # type: ignore[arg-type]


def engine() -> ScriptedEngine:
    return ScriptedEngine(lambda prompt: Reply(c("a")))


async def episode(env: object, tok: object, lim: EpisodeLimits, pid: str = "p0") -> Trajectory:
    return await run_episode(env, engine(), tok, SAMPLING, lim, seed=1, prompt_id=pid)  # type: ignore[arg-type]


def workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("sao-env-")]


def join_workers() -> None:
    for thread in workers():
        thread.join(timeout=10)


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    offloaded.forget()
    yield
    join_workers()
    offloaded.forget()


@dataclass
class Hold:
    """Where held steps block, and what they did.

    A held step blocks its thread (the mistake under test) until the test
    sets ``release``; on the event loop's own thread, where nothing could set
    it, it sleeps ``on_loop_s`` instead (the one stall the run pays)."""

    on_loop_s: float = 0.5
    release: threading.Event = field(default_factory=threading.Event)
    blocked: int = 0
    """Held steps blocking right now."""
    cancelled: int = 0
    """Held steps cancelled at their first ``await`` after waking."""
    went_on: int = 0
    """Held steps that went on past that ``await`` (an abandoned call must not)."""
    threads: list[str] = field(default_factory=list)
    """The thread of every reset and step, in order."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def block(self) -> None:
        with self.lock:
            self.blocked += 1
        if threading.current_thread() is threading.main_thread():
            time.sleep(self.on_loop_s)
        else:
            self.release.wait(timeout=60)
        with self.lock:
            self.blocked -= 1


class HeldEnv:
    """One turn; a held episode's step blocks (:class:`Hold`), then awaits once."""

    def __init__(self, hold: Hold, held: bool) -> None:
        self.hold, self.held = hold, held
        self.reply = ""

    async def reset(self, seed: int) -> str:
        self.hold.threads.append(threading.current_thread().name)
        return "hi"

    async def step(self, action: str) -> StepResult:
        self.hold.threads.append(threading.current_thread().name)
        if self.held:
            self.hold.block()
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                self.hold.cancelled += 1
                raise
            self.hold.went_on += 1
        self.reply = action
        return done(reward=1.0)

    def score(self) -> float:
        return 1.0


def blocking_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == WARNINGS]


def test_after_one_blocking_call_its_class_runs_in_threads_and_the_deadline_holds(
    chatml_tok, caplog
):
    hold, lim = Hold(), limits(step_timeout_s=0.2)
    first = asyncio.run(episode(HeldEnv(hold, held=True), chatml_tok, lim))
    # on the loop: the call held it for 0.5 s, past its 0.2 s deadline
    assert first.finish_reason == "timeout"
    assert "Env.step of HeldEnv blocked the event loop for 0.5 s" in (first.error or "")
    assert hold.threads == ["MainThread", "MainThread"]
    # (it may have run on past its next await before the loop got to cancel it: the
    # loop was not free to; its result was discarded all the same)
    on_loop = (hold.cancelled, hold.went_on)

    async def together() -> list[Trajectory]:
        slow = episode(HeldEnv(hold, held=True), chatml_tok, lim, "slow")
        quick = [episode(HeldEnv(hold, held=False), chatml_tok, lim, f"q{i}") for i in range(3)]
        return await asyncio.gather(slow, *quick)

    slow, *quick = asyncio.run(together())
    # every episode has returned while the slow call is still blocked in its thread
    assert hold.blocked == 1
    assert slow.finish_reason == "timeout"
    assert (
        slow.error
        == "Env.step of HeldEnv (in a thread) exceeded EpisodeLimits.step_timeout_s=0.2 s"
    )
    assert [(t.finish_reason, t.reward) for t in quick] == [("stop", 1.0)] * 3
    # 2 calls of the first episode, then 2 calls of each of the 4 others: all in threads
    assert hold.threads[2:] == ["sao-env-HeldEnv"] * 8
    assert offloaded.abandoned >= 1  # the slow one's thread still runs its call

    hold.release.set()
    join_workers()
    assert workers() == [] and offloaded.abandoned == 0
    # the abandoned call was cancelled at its next await: it did not go on
    assert (hold.blocked, hold.cancelled - on_loop[0], hold.went_on - on_loop[1]) == (0, 1, 0)
    warnings = blocking_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("Env.step of HeldEnv held the event loop for 0.5 s in one go")
    assert "HeldEnv.reset and .step run in a worker thread" in warnings[0]


class LoopEnv:
    """Makes a future on its loop in ``reset`` and awaits it in ``step``, which
    works only when both calls run on the same event loop."""

    async def reset(self, seed: int) -> str:
        loop = asyncio.get_running_loop()
        self.loops = [loop]
        self.key = episode_key.get()
        self.ready: asyncio.Future[str] = loop.create_future()
        loop.call_later(0.01, self.ready.set_result, "x")
        return "hi"

    async def step(self, action: str) -> StepResult:
        self.loops.append(asyncio.get_running_loop())
        await self.ready
        return done(reward=1.0)

    def score(self) -> float:
        return 1.0


def test_an_offloaded_env_keeps_one_loop_of_its_own_and_the_episode_context(chatml_tok):
    offloaded.mark(LoopEnv, "Env.step", 2.0)
    a, b = LoopEnv(), LoopEnv()

    async def both() -> tuple[Trajectory, Trajectory, asyncio.AbstractEventLoop]:
        ta, tb = await asyncio.gather(
            episode(a, chatml_tok, limits()), episode(b, chatml_tok, limits(), "p1")
        )
        return ta, tb, asyncio.get_running_loop()

    ta, tb, main = asyncio.run(both())
    assert (ta.finish_reason, tb.finish_reason) == ("stop", "stop")
    assert a.loops[0] is a.loops[1] and b.loops[0] is b.loops[1]  # reset and step: one loop
    assert a.loops[0] is not b.loops[0] and main not in (a.loops[0], b.loops[0])
    assert (a.key, b.key) == ("p0##1", "p1##1")  # the episode's context variables
    join_workers()
    assert a.loops[0].is_closed() and b.loops[0].is_closed()


class RaisingEnv(HeldEnv):
    async def step(self, action: str) -> StepResult:
        raise ValueError("grader went away")


class SyncStepEnv(HeldEnv):
    def step(self, action: str) -> StepResult:  # type: ignore[override]
        return done()


def test_an_offloaded_env_fails_as_it_would_on_the_loop(chatml_tok):
    for cls in (RaisingEnv, SyncStepEnv):
        offloaded.mark(cls, "Env.step", 2.0)
    raised = asyncio.run(episode(RaisingEnv(Hold(), False), chatml_tok, limits()))
    assert raised.finish_reason == "env_error"
    error = raised.error or ""
    assert error.startswith("Env.step of RaisingEnv (in a thread) raised ValueError: grader went")
    assert "away (at " in error and "test_blocking_env.py" in error
    sync = asyncio.run(episode(SyncStepEnv(Hold(), False), chatml_tok, limits()))
    assert sync.finish_reason == "env_error"
    assert sync.error == "Env.step must be async; it returned StepResult"


def test_abandoned_calls_are_bounded(chatml_tok, monkeypatch):
    monkeypatch.setattr(envthread, "MAX_ABANDONED", 1)
    offloaded.mark(HeldEnv, "Env.step", 2.0)
    hold, lim = Hold(), limits(step_timeout_s=0.2)
    slow = asyncio.run(episode(HeldEnv(hold, held=True), chatml_tok, lim))
    assert slow.finish_reason == "timeout" and hold.blocked == 1
    refused = asyncio.run(episode(HeldEnv(hold, held=False), chatml_tok, lim))
    assert refused.finish_reason == "timeout" and refused.num_tokens == 0
    assert "Env.reset of HeldEnv was not started: 1 calls of" in (refused.error or "")
    assert "(at most 1)" in (refused.error or "")
    hold.release.set()
    join_workers()
    assert offloaded.abandoned == 0
    again = asyncio.run(episode(HeldEnv(hold, held=False), chatml_tok, lim))
    assert again.finish_reason == "stop"


# ---------------------------------------------------------------- a short run


class EveryThirdHeld:
    """A task whose every third train episode's step blocks (the issue's case)."""

    name = "every_third_held"
    eval_size = 0

    def __init__(self, hold: Hold) -> None:
        self.hold = hold

    def make_env(self, split: Split, index: int) -> Env:
        return HeldEnv(self.hold, held=index % 3 == 2)  # type: ignore[return-value]


def test_a_run_with_a_blocking_env_finishes_while_its_calls_are_still_blocked(chatml_tok, caplog):
    hold = Hold()
    lim = limits(step_timeout_s=0.2)
    runner = LocalRunner(EveryThirdHeld(hold), engine(), chatml_tok, lim)  # type: ignore[arg-type]
    gate = StalenessGate(3, 6)  # the engine's version stays 0: lag <= 3 over 3 steps
    failures: list[Trajectory] = []
    orch = Orchestrator(
        runner,
        SAMPLING,
        gate=gate,
        buffer=TrajectoryBuffer(gate, group_size=1, dynamic_sampling=False),
        in_flight=6,
        group_size=1,
        seed=0,
        report=lambda traj, step: failures.append(traj),
    )

    async def step_fn(batch: list[Trajectory], train_actor: bool) -> dict[str, float]:
        assert all(t.finish_reason == "stop" for t in batch)  # a failure never trains
        return {}

    async def publish(version: int) -> float:
        return 0.0

    asyncio.run(orch.train(3, 6, step_fn, publish))
    still_blocked = hold.blocked
    hold.release.set()
    assert orch.consumed == 3
    # the three batches (18 healthy episodes) were played while held calls still blocked
    assert still_blocked >= 1
    assert orch.episodes_done - orch.failed >= 18
    assert failures and orch.timeouts == orch.failed == len(failures)
    assert all(f.finish_reason == "timeout" for f in failures)
    assert all(int(f.prompt_id.split("/")[1]) % 3 == 2 for f in failures)  # the held ones
    assert "Env.step of HeldEnv blocked the event loop for 0.5 s" in (failures[0].error or "")
    in_thread = "Env.step of HeldEnv (in a thread) exceeded EpisodeLimits.step_timeout_s=0.2 s"
    assert len(failures) >= 2 and all(f.error == in_thread for f in failures[1:])
    warnings = blocking_warnings(caplog)
    assert len(warnings) == 1 and "of HeldEnv held the event loop" in warnings[0]
    join_workers()
    # every call still blocked at the end was abandoned: cancelled at its next await
    assert offloaded.abandoned == 0 and hold.cancelled >= still_blocked
