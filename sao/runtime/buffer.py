"""Finished trajectories waiting for the trainer.

Single rollout (``group_size = 1``): a trajectory is trainable the moment it
finishes. Groups (GRPO family): a group is released only when all of its
members are done, and is trained or dropped as a whole. A failed episode
(:meth:`TrajectoryBuffer.fail`) gives its capacity back at once; its group is
dropped whole when its last member arrives.
"""

from __future__ import annotations

import asyncio
from collections import deque

from sao.runtime.staleness import StalenessGate
from sao.types import Trajectory


class TrajectoryBuffer:
    """FIFO of complete groups; ``take`` applies the staleness gate."""

    def __init__(self, gate: StalenessGate, *, group_size: int, dynamic_sampling: bool) -> None:
        self.gate = gate
        self.group_size = group_size
        self.dynamic_sampling = dynamic_sampling
        self.ready: deque[list[Trajectory]] = deque()
        self.pending: dict[str, list[Trajectory]] = {}
        self._failed_in: dict[str, int] = {}
        self.filtered = 0
        self.failed = 0
        """Trajectories not trained because they (or a member of their group) failed."""
        self._changed = asyncio.Event()

    def add(self, trajectory: Trajectory) -> None:
        """Add one finished trajectory; release its group when complete."""
        key = trajectory.group_id or trajectory.prompt_id
        self.pending.setdefault(key, []).append(trajectory)
        self._complete(key)

    def fail(self, trajectory: Trajectory) -> None:
        """A failed episode, never trained: its capacity is given back now."""
        key = trajectory.group_id or trajectory.prompt_id
        self.failed += 1
        self.gate.reject(1)
        self._failed_in[key] = self._failed_in.get(key, 0) + 1
        self.pending.setdefault(key, [])
        self._complete(key)

    def _complete(self, key: str) -> None:
        members = self.pending[key]
        failed = self._failed_in.get(key, 0)
        if len(members) + failed < self.group_size:
            return
        del self.pending[key]
        if failed:  # a group with a failed member is dropped whole
            del self._failed_in[key]
            self.failed += len(members)
            self.gate.reject(len(members))
        elif self.dynamic_sampling and len({t.total_reward for t in members}) == 1:
            self.filtered += len(members)  # DAPO: an all-equal group carries no signal
            self.gate.reject(len(members))
        else:
            self.ready.append(members)
        self._changed.set()

    def num_ready(self) -> int:
        """Trajectories ready to be taken."""
        return sum(len(g) for g in self.ready)

    async def take(self, n: int, version: int) -> list[Trajectory]:
        """Wait for ``n`` fresh trajectories (whole groups), oldest first; stale
        groups are dropped and counted by the gate."""
        out: list[Trajectory] = []
        while len(out) < n:
            while not self.ready:
                self._changed.clear()
                await self._changed.wait()
            group = self.ready.popleft()
            if all(self.gate.lag(t, version) <= self.gate.max_lag for t in group):
                out.extend(group)
            else:
                for t in group:
                    self.gate.is_fresh(t, version)  # counts the drop
                # fresh siblings of a stale member are rejected with it
                fresh = [t for t in group if self.gate.lag(t, version) <= self.gate.max_lag]
                self.gate.reject(len(fresh))
        return out

    def snapshot(self) -> list[Trajectory]:
        """Every finished trajectory held (ready and partial groups), for checkpoints."""
        done = [t for g in self.ready for t in g]
        return done + [t for g in self.pending.values() for t in g]
