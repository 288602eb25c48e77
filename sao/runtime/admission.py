"""When to start the next episode: as late as possible, with the trainer still fed.

The staleness gate (:mod:`sao.runtime.staleness`) lets rollouts run up to
``max_lag + 1`` batches ahead of the trainer. When the trainer is the
bottleneck, that static rule keeps the buffer full: every trajectory then
waits until it is as stale as allowed (``staleness/mean`` equal to
``max_lag``), and the trainer is no busier for it.

:class:`JustInTime` chooses ``ahead``: how many batches, beyond the one the
trainer is training on (or waiting for), may be generated now. The gate
admits up to ``(s + 1 + ahead) x B`` episodes (``s`` batches consumed, ``B``
the batch size); the static rule is ``ahead = max_lag``, and ``ahead`` never
exceeds it; the drop rule is unchanged. ``ahead`` is set by feedback on what
the trainer finds when it asks for a batch, the one thing that matters:

* the batch was late (the trainer waited more than ``wait_frac`` of its step
  time): ``ahead += up``, at once;
* it was ready and ``r`` more trajectories were ready beside it (waiting,
  growing staler): ``ahead -= gain * r / B``.

A trainer-bound run settles at ``ahead = 1``: the next batch is generated
while the trainer trains on this one, nothing more, so its trajectories are
about one version stale instead of ``max_lag``. A rollout-bound run (the
trainer waits whatever is started) climbs to ``max_lag``, the static rule:
there is no staleness to save there. With a long tail of episode durations,
``ahead`` settles where batches are rarely late; the stragglers of each
batch fill later ones.

The controller also estimates the trainer's busy time per step and a high
quantile of episode durations (logged as ``admission/step_s`` and
``admission/episode_s``); they explain ``ahead`` but do not set it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class JustInTime:
    """Batches that may be generated ahead of the trainer, by feedback (see the
    module docstring)."""

    max_ahead: int
    """``max_lag``: the static rule's ``ahead``, never exceeded."""
    ahead: float = 1.0
    up: float = 1.0
    """Batches added after a late batch."""
    gain: float = 0.25
    """Share of the surplus (in batches) given back per step it was seen."""
    wait_frac: float = 0.05
    """A wait longer than this share of the trainer's step time makes a batch late."""
    quantile: float = 0.95
    """Quantile of recent episode durations reported as ``episode_s``."""
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=128))
    busy: deque[float] = field(default_factory=lambda: deque(maxlen=8))
    took_at: float | None = None
    waits: int = 0
    """Steps whose batch was late."""

    def __post_init__(self) -> None:
        if self.max_ahead < 0:
            raise ValueError(f"max_ahead must be >= 0, got {self.max_ahead}")
        self.ahead = min(max(self.ahead, 0.0), float(self.max_ahead))

    def episode_done(self, seconds: float) -> None:
        """An episode finished ``seconds`` after it started."""
        self.durations.append(max(seconds, 0.0))

    def ask(self, now: float) -> None:
        """The trainer starts waiting for its next batch."""
        if self.took_at is not None:
            self.busy.append(max(now - self.took_at, 0.0))

    def took(self, now: float, *, waited_s: float, surplus: int, batch_size: int) -> None:
        """The trainer got its batch after ``waited_s``, with ``surplus`` more
        trajectories ready beside it."""
        step = self.step_s()
        if step is not None and waited_s > self.wait_frac * step:
            self.waits += 1
            self.ahead = min(self.ahead + self.up, float(self.max_ahead))
        else:
            self.ahead = max(self.ahead - self.gain * surplus / batch_size, 0.0)
        self.took_at = now

    def capacity(self, consumed: int, batch_size: int) -> int:
        """Episodes that may have been started (less those rejected) when the
        trainer has consumed ``consumed`` batches."""
        return (consumed + 1) * batch_size + math.ceil(self.ahead * batch_size - 1e-9)

    def step_s(self) -> float | None:
        """The median trainer busy time per step (None until measured)."""
        return statistics.median(self.busy) if self.busy else None

    def episode_s(self) -> float | None:
        """The ``quantile`` of recent episode durations (None until one finished)."""
        if not self.durations:
            return None
        ordered = sorted(self.durations)
        return ordered[min(math.ceil(self.quantile * len(ordered)), len(ordered)) - 1]
