"""The asynchronous pipeline: rollout workers keep episodes in flight, each
finished trajectory goes straight to the buffer, the trainer takes batches as
they arrive and publishes weights to the engine after every actor step, which
applies them while episodes are still running.

Synchronous training is the same code with ``max_lag = 0`` (the staleness
gate then admits exactly one batch per version).

``lockstep`` (``runtime.admission=fixed``) makes staleness a controlled
variable, a measurement device rather than a speed feature: the batch the
trainer takes at step ``s`` is exactly ``max_lag`` versions old (less during
the first ``max_lag`` steps, generated at version 0). The rollouts of batch
``s + max_lag + 1`` run while the trainer trains on batch ``s``; before it
publishes, the trainer waits until they have all finished, and only after the
publish may the next batch start. So no episode spans a weight update and
every trajectory of a batch was sampled by one version, whatever the relative
speed of trainer and rollouts.

An episode that fails (``env_error``, ``timeout``, ``error``, or an exception
from the runner) is counted and reported, and gives its capacity back; it is
never trained as its score (:class:`FailurePolicy`). Only a failure the run
cannot survive stops it: no live engine, too many failures in a row, or the
watchdog (no episode finished and no step completed for ``watchdog_s``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from sao.rollout.envcall import describe_error, stalls
from sao.rollout.progress import progress
from sao.rollout.remote.router import NoLiveEngineError
from sao.rollout.resume import EpisodeResume
from sao.runtime.admission import JustInTime
from sao.runtime.buffer import TrajectoryBuffer
from sao.runtime.evaluate import reported_means
from sao.runtime.runner import EpisodeRunner, Played, samples
from sao.runtime.staleness import StalenessGate
from sao.types import FAILURES, SamplingParams, StepFn, Trajectory, failed_trajectory

_T = TypeVar("_T")
PublishFn = Callable[[int], Awaitable[float]]
"""Sends the trainer's weights to the engines as ``version``; returns the seconds it took."""


_COUNTERS = (
    "episodes_done",
    "env_errors",
    "timeouts",
    "errors",
    "failed",
    "tokens_done",
    "observations_truncated",
    "failures_in_a_row",
    "tito_checked",
    "tito_mismatches",
    "tito_rewrites",
    "warmup_ended",
)
"""Orchestrator attributes that are running totals over the whole run."""


class RunStopped(RuntimeError):
    """The run stopped itself: too many failed episodes in a row, or no progress."""


@dataclass(frozen=True)
class FailurePolicy:
    """What a failed episode becomes.

    ``reward``: None drops failed episodes (never trained; a group with a
    failed member is dropped whole), else they are trained with this outcome
    reward (and no per-turn rewards) in place of their score. Episodes that
    failed before their first sampled token are always dropped.
    ``max_in_a_row``: stop the run after this many failures in a row.
    ``watchdog_s``: stop the run when no episode finishes and no step
    completes for this long (0: off).
    """

    reward: float | None = None
    max_in_a_row: int = 100
    watchdog_s: float = 900.0


Report = Callable[[Trajectory, int], None]
"""Told about every failed episode and the step it would have fed (e.g. to print
and log it)."""


@dataclass
class RolloutState:
    """Where the prompt stream stands (checkpointed)."""

    next_index: int = 0
    """Next train prompt index to start."""
    restart: list[int] = field(default_factory=list)
    """Prompt indices that were in flight at the last checkpoint: started again first."""
    in_flight: dict[int, int] = field(default_factory=dict)
    """Prompt index -> episodes of it still running."""
    resume: dict[str, EpisodeResume] = field(default_factory=dict)
    """``"index/member"`` -> a checkpointed history to continue that episode from."""


@dataclass
class Clock:
    """Idle accounting: the trainer waiting for data, rollouts held back by the gate."""

    trainer_idle_s: float = 0.0
    rollout_idle_s: float = 0.0
    start: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class Orchestrator:
    """Rollout workers (episodes played by ``runner``) + the trainer loop."""

    def __init__(
        self,
        runner: EpisodeRunner,
        sampling: SamplingParams,
        *,
        gate: StalenessGate,
        buffer: TrajectoryBuffer,
        in_flight: int,
        group_size: int,
        seed: int,
        state: RolloutState | None = None,
        failure: FailurePolicy | None = None,
        report: Report | None = None,
        admission: JustInTime | None = None,
        lockstep: bool = False,
    ) -> None:
        self.runner, self.sampling = runner, sampling
        self.admission = admission
        """Just-in-time admission (None: the gate's static rule, ``max_lag + 1`` batches)."""
        if lockstep and admission is not None:
            raise ValueError("lockstep admission takes no just-in-time controller")
        self.lockstep = lockstep
        """Every batch exactly ``max_lag`` versions old (see the module docstring)."""
        self.released = 0
        """Batches whose capacity the gate has released: ``consumed``, except that in
        lockstep a batch's capacity is released only after its publish."""
        self.failure, self.report = failure or FailurePolicy(), report
        self.gate, self.buffer = gate, buffer
        self.in_flight, self.group_size, self.seed = in_flight, group_size, seed
        self.state = state or RolloutState()
        self.consumed = 0
        self.version = 0
        self.clock = Clock()
        self.episodes_done = 0
        self.env_errors = 0
        self.timeouts = 0
        self.errors = 0
        self.failed = 0
        self.tokens_done = 0
        self.observations_truncated = 0
        self.failures_in_a_row = 0
        self.tito_checked = self.tito_mismatches = self.tito_rewrites = 0
        self.warmup_ended = 0
        """1 once the trainer reported its critic-only warm-up done early
        (``critic/pretrain_plateau``): every later batch is an actor step."""
        """Episodes given the token-in/token-out check, and those it found a
        mismatch or a template rewrite in (:mod:`sao.rollout.tito`)."""
        self.last_progress = time.monotonic()
        self.doing = "starting"
        """What the trainer side is doing (for the watchdog's message)."""
        self._running = 0
        self._fatal: BaseException | None = None
        self._wake = asyncio.Event()
        self._ended = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ rollout side

    async def produce(self) -> None:
        """Keep ``in_flight`` episodes running, within the gate's capacity."""
        G, jit, B = self.group_size, self.admission, self.gate.batch_size
        while True:
            if self._fatal is not None:  # an episode hit an error the run cannot survive
                raise self._fatal
            s = self.released if self.lockstep else self.consumed
            cap = None if jit is None else jit.capacity(s, B)
            if self._running + G <= self.in_flight and self.gate.can_start(s, G, capacity=cap):
                self._start_group(self._next_index())
                continue
            t0 = time.perf_counter()
            self._wake.clear()
            await self._wake.wait()
            if self._running == 0:  # nothing generating: the rollout side sat idle
                self.clock.rollout_idle_s += time.perf_counter() - t0

    def _next_index(self) -> int:
        if self.state.restart:
            return self.state.restart.pop(0)
        self.state.next_index += 1
        return self.state.next_index - 1

    def _start_group(self, index: int) -> None:
        self.gate.start(self.group_size)
        self.state.in_flight[index] = self.group_size
        for member in range(self.group_size):
            self._running += 1
            task = asyncio.create_task(self._episode(index, member))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _episode(self, index: int, member: int) -> None:
        ids = {"prompt_id": f"train/{index}", "group_id": f"train/{index}"}
        started = time.perf_counter()
        resume = self.state.resume.pop(f"{index}/{member}", None)
        try:
            try:
                traj = await self.runner.run(
                    "train",
                    index,
                    seed=self._seed(index, member),
                    sampling=self.sampling,
                    resume=resume,
                    **ids,
                )
            except (asyncio.CancelledError, NoLiveEngineError):
                raise
            except Exception as err:  # an engine error, or a bug: this episode fails
                why = f"the episode raised {describe_error(err)}"
                traj = failed_trajectory(**ids, sampling=self.sampling, reason="error", error=why)
            if self.admission is not None:
                self.admission.episode_done(time.perf_counter() - started)
            for sample in self._samples(traj):
                self._finished(sample)
        except NoLiveEngineError as err:  # the run cannot go on
            self._stop(err)
        finally:
            self._running -= 1
            left = self.state.in_flight.get(index, 1) - 1
            if left <= 0:
                self.state.in_flight.pop(index, None)
            else:
                self.state.in_flight[index] = left
            self._wake.set()
            self._ended.set()

    def _samples(self, played: Played) -> list[Trajectory]:
        """An episode's samples; beyond the first, each counts as one more episode
        started (so the staleness gate sees every trajectory it will be asked to train)."""
        out = samples(played)
        if len(out) > 1 and self.group_size > 1:  # a group needs one sample per member
            why = f"the episode gave {len(out)} samples (one per model call); a group needs one"
            return [replace(out[0], reward=0.0, finish_reason="error", error=why)]
        self.gate.start(len(out) - 1)
        return out

    def _seed(self, index: int, member: int) -> int:
        return self.seed * 1_000_003 + index * 131 + member

    async def take_resumes(self, indices: Sequence[int]) -> dict[str, EpisodeResume]:
        """``"index/member"`` -> snapshot, for the episodes of ``indices`` that can be
        continued after a checkpoint: the running ones caught between turns, and
        the ones still waiting to be continued from the previous checkpoint."""
        keys = {
            f"train/{i}#train/{i}#{self._seed(i, m)}": f"{i}/{m}"
            for i in indices
            for m in range(self.group_size)
        }
        taken = await self.runner.take_resumes(list(keys))
        waiting = {k: r for k, r in self.state.resume.items() if int(k.split("/")[0]) in indices}
        return waiting | {keys[key]: r for key, r in taken.items()}

    def _finished(self, traj: Trajectory) -> None:
        self._account(traj)
        self.last_progress = time.monotonic()
        mismatch = traj.metrics.get("tito/mismatch", 0.0) > 0
        if traj.metrics.get("tito/checked"):
            self.tito_checked += 1
            self.tito_mismatches += mismatch
            self.tito_rewrites += traj.metrics.get("tito/rewrite", 0.0) > 0
        if mismatch and traj.metrics.get("tito/stop"):
            self._stop(
                RunStopped(
                    f"episode {traj.prompt_id} failed the token-in/token-out check "
                    f"(rollout.tito_check=stop): {traj.error}. Fix the template or the "
                    "environment, or set rollout.tito_check=drop (drop such episodes) or warn"
                )
            )
        if traj.finish_reason not in FAILURES:
            self.failures_in_a_row = 0
            if mismatch and self.tito_mismatches == 1 and self.report is not None:
                self.report(traj, self.consumed + 1)  # warn: trained, named once, then counted
            self.buffer.add(traj)
            return
        self.failed += 1
        self.failures_in_a_row += 1
        if self.report is not None:
            self.report(traj, self.consumed + 1)
        if self.failures_in_a_row >= self.failure.max_in_a_row:
            self._stop(
                RunStopped(
                    f"{self.failures_in_a_row} episodes in a row failed (rollout."
                    f"max_failures_in_a_row); the last, {traj.prompt_id}, ended "
                    f"{traj.finish_reason}: {traj.error}"
                )
            )
        reward = self.failure.reward
        if reward is None or traj.num_action_tokens == 0:
            self.buffer.fail(traj)
        else:
            turns = tuple(replace(t, reward=0.0) for t in traj.turns)
            self.buffer.add(replace(traj, reward=reward, turns=turns))

    def _stop(self, err: BaseException) -> None:
        if self._fatal is None:
            self._fatal = err
        self._wake.set()

    def counters(self) -> dict[str, float]:
        """The run's running totals (checkpointed, restored by :meth:`load_counters`)."""
        return {name: float(getattr(self, name)) for name in _COUNTERS} | {
            "wall_s": self.clock.elapsed(),
            "trainer_idle_s": self.clock.trainer_idle_s,
            "rollout_idle_s": self.clock.rollout_idle_s,
        }

    def load_counters(self, saved: dict[str, float]) -> None:
        """Continue the totals of :meth:`counters` (missing keys stay at 0)."""
        for name in _COUNTERS:
            setattr(self, name, int(saved.get(name, 0)))
        self.clock.start = time.perf_counter() - float(saved.get("wall_s", 0.0))
        self.clock.trainer_idle_s = float(saved.get("trainer_idle_s", 0.0))
        self.clock.rollout_idle_s = float(saved.get("rollout_idle_s", 0.0))

    def _account(self, traj: Trajectory) -> None:
        self.episodes_done += 1
        self.tokens_done += traj.num_tokens
        self.env_errors += traj.finish_reason == "env_error"
        self.timeouts += traj.finish_reason == "timeout"
        self.errors += traj.finish_reason == "error"
        self.observations_truncated += int(traj.metrics.get("observations_truncated", 0))

    # ------------------------------------------------------------------ trainer side

    async def train(
        self,
        steps: int,
        batch_size: int,
        step_fn: StepFn,
        publish: PublishFn,
        *,
        warmup_steps: int = 0,
        on_step: Callable[[int, dict[str, float]], Awaitable[None]] | None = None,
    ) -> None:
        """Consume ``steps`` batches: the first ``warmup_steps`` train only the
        critic (no publish), then each actor step publishes version ``v + 1``. A
        warm-up step whose metrics hold ``critic/pretrain_plateau`` = 1 ends the
        warm-up early: the batches left of it train the actor too."""
        self.released = self.consumed
        producer = asyncio.create_task(self.produce())
        guards = {producer, asyncio.create_task(self._watchdog())}
        try:
            while self.consumed < steps:
                self.doing = f"waiting for the batch of step {self.consumed + 1}"
                t0 = time.perf_counter()
                if self.admission is not None:
                    self.admission.ask(t0)
                batch = await self._guarded(self.buffer.take(batch_size, self.version), guards)
                t_took = time.perf_counter()
                self.clock.trainer_idle_s += t_took - t0
                if self.admission is not None:
                    surplus = self.buffer.num_ready()
                    self.admission.took(
                        t_took, waited_s=t_took - t0, surplus=surplus, batch_size=batch_size
                    )
                    self._wake.set()  # ahead may have grown
                train_actor = self.consumed >= warmup_steps or bool(self.warmup_ended)
                taken_at = self.version
                self.doing = f"training step {self.consumed + 1}"
                t1 = time.perf_counter()
                metrics = await self._guarded(step_fn(batch, train_actor), guards)
                metrics["time/train_step_s"] = time.perf_counter() - t1
                if self.lockstep:
                    metrics["time/lockstep_wait_s"] = await self._guarded(self._generated(), guards)
                self.consumed += 1
                if not train_actor and metrics.get("critic/pretrain_plateau", 0.0) >= 1.0:
                    self.warmup_ended = 1
                if train_actor:
                    self.version += 1
                    self.doing = f"publishing weight version {self.version}"
                    metrics["publish/sync_s"] = await self._guarded(publish(self.version), guards)
                    self.runner.set_train_step(self.version)
                self.released = self.consumed
                self.last_progress = time.monotonic()
                self._wake.set()
                metrics |= self.runtime_metrics(batch, taken_at)
                if on_step is not None:
                    self.doing = f"evaluating or checkpointing after step {self.consumed}"
                    await self._guarded(on_step(self.consumed, metrics), guards)
                    self.last_progress = time.monotonic()
        finally:
            for guard in guards:
                guard.cancel()
            await self.cancel_episodes()

    async def _generated(self) -> float:
        """Wait until every episode the gate admits before the next release has
        finished (lockstep): none running and no capacity left to start one.
        Returns the seconds waited."""
        self.doing = f"waiting for the rollouts that run during step {self.consumed + 1}"
        t0, G = time.perf_counter(), self.group_size
        while self._running > 0 or self.gate.can_start(self.released, G):
            self._ended.clear()
            self._wake.set()  # a rejected episode's capacity may be waiting to refill
            await self._ended.wait()
        return time.perf_counter() - t0

    async def _guarded(self, work: Awaitable[_T], guards: set[asyncio.Task[None]]) -> _T:
        """``await work``, unless the producer or the watchdog stops first: then
        their error is raised (never a hang)."""
        main = asyncio.ensure_future(work)
        done, _ = await asyncio.wait({main, *guards}, return_when=asyncio.FIRST_COMPLETED)
        if main in done:
            return main.result()
        main.cancel()
        for guard in done:
            guard.result()  # raises the producer's (or the watchdog's) error
        raise RuntimeError("the rollout producer stopped unexpectedly")

    async def _watchdog(self) -> None:
        """Raise :class:`RunStopped` when nothing progresses for ``watchdog_s``."""
        limit = self.failure.watchdog_s
        if limit <= 0:
            await asyncio.Event().wait()  # off: wait forever (cancelled at the end)
        while True:
            await asyncio.sleep(min(limit / 4, 5.0))
            idle = time.monotonic() - max(self.last_progress, progress.last_end)
            if idle >= limit:
                raise RunStopped(self.hang_report(idle))

    def hang_report(self, idle_s: float) -> str:
        """What the run is waiting on, on one line."""
        g = self.gate
        capacity = (self.consumed + g.max_lag + 1) * g.batch_size
        if self.admission is not None:
            capacity = min(capacity, self.admission.capacity(self.consumed, g.batch_size))
        waiting = progress.describe() or [f"train/{i}" for i in sorted(self.state.in_flight)]
        return (
            f"no episode finished and no step completed for {idle_s:.0f} s "
            f"(runtime.watchdog_s={self.failure.watchdog_s:g}); the trainer is {self.doing}; "
            f"the staleness gate holds {g.started - g.rejected} of {capacity} episodes, the "
            f"buffer {self.buffer.num_ready()} ready and {len(self.buffer.pending)} groups "
            f"incomplete; {self._running} episode(s) in flight"
            + (": " + "; ".join(waiting) if waiting else "")
        )

    def runtime_metrics(self, batch: Sequence[Trajectory], taken_at: int) -> dict[str, float]:
        """Staleness (versions behind the trainer when taken), drops, errors,
        throughput and idle fractions; ``tito/mismatch_frac`` and
        ``tito/rewrite_frac``: shares of the episodes checked since the start of
        the run that failed the token-in/token-out check or whose template
        rewrote a reply (:mod:`sao.rollout.tito`); and ``NAME``, the batch's mean
        of each ``metric/NAME`` its environments reported (``format/missing_answer``)."""
        lags = [self.gate.lag(t, taken_at) for t in batch]
        wall = max(self.clock.elapsed(), 1e-9)
        reported = {k.removeprefix("metric/"): v for k, v in reported_means(batch).items()}
        return (
            reported
            | {
                "staleness/mean": sum(lags) / max(len(lags), 1),
                "staleness/max": float(max(lags, default=0)),
                "staleness/min": float(min(lags, default=0)),
                "dropped/stale": float(self.gate.dropped),
                "dropped/filtered": float(self.buffer.filtered),
                "dropped/failed": float(self.buffer.failed),
                "episodes/env_error": float(self.env_errors),
                "episodes/timeout": float(self.timeouts),
                "episodes/error": float(self.errors),
                "episodes/failed": float(self.failed),
                "episodes/observations_truncated": float(self.observations_truncated),
                "tito/mismatch_frac": self.tito_mismatches / max(self.tito_checked, 1),
                "tito/rewrite_frac": self.tito_rewrites / max(self.tito_checked, 1),
                "env/max_block_s": stalls.take_max(),
                "throughput/trajectories_per_s": self.episodes_done / wall,
                "throughput/tokens_per_s": self.tokens_done / wall,
                "idle/trainer_frac": self.clock.trainer_idle_s / wall,
                "idle/rollout_frac": self.clock.rollout_idle_s / wall,
                "version": float(self.version),
            }
            | self._admission_metrics()
            | self.runner.metrics()
        )

    def _admission_metrics(self) -> dict[str, float]:
        """``admission/ahead`` (batches that may be generated beyond the one in
        training), ``admission/waits`` (steps whose batch was late), and the
        estimates ``admission/step_s`` (trainer busy per step) and
        ``admission/episode_s`` (a high quantile of episode durations)."""
        jit = self.admission
        if jit is None:
            return {}
        return {
            "admission/ahead": jit.ahead,
            "admission/waits": float(jit.waits),
            "admission/step_s": jit.step_s() or 0.0,
            "admission/episode_s": jit.episode_s() or 0.0,
        }

    async def cancel_episodes(self) -> None:
        """Cancel every running episode (their prompts are restarted on resume)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
