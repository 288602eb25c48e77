"""A projection of measured episode traces to a cluster (docs/scaling.md).

The model, and its assumptions:

- An episode's duration is its generation work over a per-sequence decode
  rate: ``d = tokens / rate``. Engines batch continuously, so a sequence
  decodes at about the same rate however many others run beside it, up to
  ``slots`` sequences per engine; beyond ``engines x slots`` episodes wait.
  Tool time and prefill are folded into the measured rate.
- A cluster is described by two numbers, not derived from model size here:
  the per-sequence decode rate (tokens/s; e.g. ~30-100 for an 8B model on
  one modern GPU under continuous batching) and the trainer's step time for
  one batch (set by model size, batch tokens and trainer GPUs). The rows
  printed are a grid of both; plug in your own.
- Synchronous GRPO: a step starts its batch's episodes together, waits for
  the slowest, then trains; engines sit idle while it trains.
- Asynchronous SAO: the staleness gate admits up to ``(s + L + 1) x B``
  episodes (``s`` batches trained, static admission), the trainer takes the
  first ``B`` finished, in the order they finish, and trains while the others
  run; the drop rule is not modelled (no trajectory here is older than ``L``).
  A trajectory's staleness is the number of actor steps published
  between its start and the step that takes it.
- Episode work is resampled from the measured traces (with replacement), so
  the tail is the measured one; the engines never fail.
"""

from __future__ import annotations

import heapq
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Trace:
    """One measured episode: seconds from reset to score, turns, generated characters."""

    seconds: float
    turns: int
    tokens: int


@dataclass(frozen=True)
class Projection:
    step_s: float
    trainer_idle: float
    staleness: float


def sync_step(durations: Sequence[float], train_s: float) -> Projection:
    """Synchronous: wait for the slowest episode of each batch, then train."""
    gen = statistics.fmean(durations)
    return Projection(gen + train_s, gen / (gen + train_s), 0.0)


def simulate_async(
    work: Sequence[float], batch: int, train_s: float, *, max_lag: int, slots: int
) -> Projection:
    """Asynchronous with the static gate: event simulation over ``work`` (episode
    durations, in admission order); returns mean step time, idle and staleness."""
    now, consumed, version, started, idle = 0.0, 0, 0, 0, 0.0
    running: list[tuple[float, int]] = []  # (finish time, version at start)
    done: list[tuple[float, int]] = []
    lags: list[int] = []
    steps = len(work) // batch - max_lag - 1

    def admit() -> None:
        nonlocal started
        cap = (consumed + max_lag + 1) * batch
        while started < min(cap, len(work)) and len(running) < slots:
            heapq.heappush(running, (now + work[started], version))
            started += 1

    admit()
    for _ in range(steps):
        while len(done) < batch:  # the trainer waits for its batch
            t, v = heapq.heappop(running)
            idle += max(t - now, 0.0)
            now = max(now, t)
            done.append((t, v))
            admit()
        taken, done = done[:batch], done[batch:]
        lags += [version - v for _, v in taken]
        end = now + train_s  # train; episodes finishing meanwhile are buffered
        while running and running[0][0] <= end:
            t, v = heapq.heappop(running)
            done.append((t, v))
            now = t
            admit()
        now, version, consumed = end, version + 1, consumed + 1  # counted once trained
        admit()
    return Projection(now / steps, idle / now, statistics.fmean(lags))


def project(
    traces: Sequence[Trace],
    *,
    batch: int,
    train_step_s: float,
    rates: Sequence[float] = (50.0,),
    train_steps_s: Sequence[float] = (5.0, 30.0, 120.0),
    engines: int = 8,
    slots: int = 64,
    max_lag: int = 4,
    steps: int = 200,
    seed: int = 0,
) -> list[str]:
    """Lines of the projection table: this machine (measured rate and step time),
    then every (decode rate, train step time) pair of the grid."""
    here = statistics.median(t.tokens / max(t.seconds, 1e-9) for t in traces)
    rng = random.Random(seed)
    tokens = [rng.choice(traces).tokens for _ in range((steps + max_lag + 2) * batch)]
    out = [
        f"projection ({engines} engines x {slots} sequences, batch {batch}, max_lag {max_lag}, "
        f"{steps} steps, episode work resampled from {len(traces)} measured episodes; "
        "benchmarks/longtail_model.py):"
    ]
    rows = [(here, train_step_s, "here")] + [(r, t, "") for r in rates for t in train_steps_s]
    for rate, train_s, label in rows:
        work = [n / rate for n in tokens]
        batches = [work[i : i + batch] for i in range(0, steps * batch, batch)]
        sync = sync_step([max(b) for b in batches], train_s)
        a = simulate_async(work, batch, train_s, max_lag=max_lag, slots=engines * slots)
        out.append(
            f"  {label or 'cluster':7s} {rate:6.0f} tokens/s/sequence, "
            f"train step {train_s:6.1f} s: "
            f"sync {sync.step_s:7.1f} s/step (trainer idle {sync.trainer_idle:.2f}), async "
            f"{a.step_s:7.1f} s/step (trainer idle {a.trainer_idle:.2f}, staleness "
            f"{a.staleness:.2f}): async {sync.step_s / a.step_s:.2f}x faster"
        )
    return out
