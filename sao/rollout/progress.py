"""What every running episode is doing right now, for the run's watchdog.

``run_episode`` records each phase (``Env.reset``, ``generate turn 3``,
``Env.step turn 3``, ...) under the episode's key; when a run stops making
progress, :meth:`EpisodeProgress.describe` says what each episode in flight
is waiting on and for how long.
"""

from __future__ import annotations

import time

from sao.rollout.engine import episode_key

__all__ = ["EpisodeProgress", "progress"]


class EpisodeProgress:
    """Episode key -> (phase, since when)."""

    def __init__(self) -> None:
        self._now: dict[str, tuple[str, float]] = {}
        self.last_end = time.monotonic()
        """When an episode last ended (``time.monotonic``)."""

    def enter(self, phase: str) -> None:
        """The current episode (``episode_key``) is now in ``phase``."""
        key = episode_key.get()
        if key is not None:
            self._now[key] = (phase, time.monotonic())

    def end(self, key: str) -> None:
        self._now.pop(key, None)
        self.last_end = time.monotonic()

    def describe(self, limit: int = 20) -> list[str]:
        """``key: phase for N s`` per running episode, longest waiting first."""
        now = time.monotonic()
        rows = sorted(self._now.items(), key=lambda kv: kv[1][1])
        lines = [f"{key.split('#')[0]}: {phase} for {now - t:.0f} s" for key, (phase, t) in rows]
        if len(lines) > limit:
            lines = [*lines[:limit], f"... and {len(lines) - limit} more"]
        return lines


progress = EpisodeProgress()
"""This process's episodes."""
