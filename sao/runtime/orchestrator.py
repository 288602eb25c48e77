"""The asynchronous pipeline: rollout workers keep episodes in flight, each
finished trajectory goes straight to the buffer, the trainer takes batches as
they arrive and publishes weights to the engine after every actor step, which
applies them while episodes are still running.

Synchronous training is the same code with ``max_lag = 0`` (the staleness
gate then admits exactly one batch per version).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from sao.runtime.buffer import TrajectoryBuffer
from sao.runtime.runner import EpisodeRunner
from sao.runtime.staleness import StalenessGate
from sao.types import SamplingParams, Trajectory

StepFn = Callable[[list[Trajectory], bool], Awaitable[dict[str, float]]]
"""Trains on one batch (``train_actor`` False during critic warm-up); returns metrics."""
PublishFn = Callable[[int], Awaitable[float]]
"""Sends the trainer's weights to the engines as ``version``; returns the seconds it took."""


@dataclass
class RolloutState:
    """Where the prompt stream stands (checkpointed)."""

    next_index: int = 0
    """Next train prompt index to start."""
    restart: list[int] = field(default_factory=list)
    """Prompt indices that were in flight at the last checkpoint: started again first."""
    in_flight: dict[int, int] = field(default_factory=dict)
    """Prompt index -> episodes of it still running."""


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
    ) -> None:
        self.runner, self.sampling = runner, sampling
        self.gate, self.buffer = gate, buffer
        self.in_flight, self.group_size, self.seed = in_flight, group_size, seed
        self.state = state or RolloutState()
        self.consumed = 0
        self.version = 0
        self.clock = Clock()
        self.episodes_done = 0
        self.env_errors = 0
        self.timeouts = 0
        self.tokens_done = 0
        self._running = 0
        self._fatal: BaseException | None = None
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ rollout side

    async def produce(self) -> None:
        """Keep ``in_flight`` episodes running, within the gate's capacity."""
        G = self.group_size
        while True:
            if self._fatal is not None:  # an episode hit an error the run cannot survive
                raise self._fatal
            if self._running + G <= self.in_flight and self.gate.can_start(self.consumed, G):
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
        try:
            traj = await self.runner.run(
                "train",
                index,
                seed=self.seed * 1_000_003 + index * 131 + member,
                prompt_id=f"train/{index}",
                group_id=f"train/{index}",
                sampling=self.sampling,
            )
            self._account(traj)
            self.buffer.add(traj)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # engine failure, or a bug: stop the run, do not hang it
            if self._fatal is None:
                self._fatal = err
        finally:
            self._running -= 1
            left = self.state.in_flight.get(index, 1) - 1
            if left <= 0:
                self.state.in_flight.pop(index, None)
            else:
                self.state.in_flight[index] = left
            self._wake.set()

    def _account(self, traj: Trajectory) -> None:
        self.episodes_done += 1
        self.tokens_done += traj.num_tokens
        self.env_errors += traj.finish_reason == "env_error"
        self.timeouts += traj.finish_reason == "timeout"

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
        critic (no publish), then each actor step publishes version ``v + 1``."""
        producer = asyncio.create_task(self.produce())
        try:
            while self.consumed < steps:
                t0 = time.perf_counter()
                batch = await self._take(batch_size, producer)
                self.clock.trainer_idle_s += time.perf_counter() - t0
                train_actor = self.consumed >= warmup_steps
                taken_at = self.version
                t1 = time.perf_counter()
                metrics = await step_fn(batch, train_actor)
                metrics["time/train_step_s"] = time.perf_counter() - t1
                self.consumed += 1
                if train_actor:
                    self.version += 1
                    metrics["publish/sync_s"] = await publish(self.version)
                    self.runner.set_train_step(self.version)
                self._wake.set()
                metrics |= self.runtime_metrics(batch, taken_at)
                if on_step is not None:
                    await on_step(self.consumed, metrics)
        finally:
            producer.cancel()
            await self.cancel_episodes()

    async def _take(self, n: int, producer: asyncio.Task[None]) -> list[Trajectory]:
        take = asyncio.ensure_future(self.buffer.take(n, self.version))
        done, _ = await asyncio.wait({take, producer}, return_when=asyncio.FIRST_COMPLETED)
        if producer in done:  # the producer died: surface its error, never hang
            take.cancel()
            producer.result()
            raise RuntimeError("the rollout producer stopped unexpectedly")
        return take.result()

    def runtime_metrics(self, batch: Sequence[Trajectory], taken_at: int) -> dict[str, float]:
        """Staleness (versions behind the trainer when taken), drops, errors,
        throughput and idle fractions."""
        lags = [self.gate.lag(t, taken_at) for t in batch]
        wall = max(self.clock.elapsed(), 1e-9)
        return {
            "staleness/mean": sum(lags) / max(len(lags), 1),
            "staleness/max": float(max(lags, default=0)),
            "dropped/stale": float(self.gate.dropped),
            "dropped/filtered": float(self.buffer.filtered),
            "episodes/env_error": float(self.env_errors),
            "episodes/timeout": float(self.timeouts),
            "throughput/trajectories_per_s": self.episodes_done / wall,
            "throughput/tokens_per_s": self.tokens_done / wall,
            "idle/trainer_frac": self.clock.trainer_idle_s / wall,
            "idle/rollout_frac": self.clock.rollout_idle_s / wall,
            "version": float(self.version),
        } | self.runner.metrics()

    async def cancel_episodes(self) -> None:
        """Cancel every running episode (their prompts are restarted on resume)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
