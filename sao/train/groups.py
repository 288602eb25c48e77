"""One trainer step split across two groups of ranks: the critic on ranks of
its own (``runtime.critic_ranks``), the actor on the others.

The step is :meth:`Trainer.step`'s, cut where the actor needs the critic:

1. critic group, :func:`critic_targets`: the batch's values and the targets
   (advantages for the actor, lambda=1 returns for the critic), exactly as
   ``step`` computes them;
2. then at once, on the two groups: :func:`critic_update` (the K critic
   steps on those targets) and :func:`actor_update` (the actor's step on the
   advantages), so the critic's K updates overlap the actor's update instead
   of preceding it.

A preset whose advantages come from the critic *after* its update
(``advantages_after_critic_update``) cannot overlap: :func:`critic_targets`
then runs the update itself and returns the new advantages. Either way the
updated weights are the colocated step's (tests/train/test_groups.py). NaN/inf
steps are counted per group: each stops the run after ``max_bad_steps`` bad
steps of its own model in a row.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sao.train.estimators import Stats, Targets
from sao.train.trainer import Trainer, to_cpu
from sao.types import Batch, Trajectory

__all__ = ["CriticPending", "actor_update", "critic_targets", "critic_update", "merge_stats"]


@dataclass
class CriticPending:
    """What :func:`critic_targets` leaves for :func:`critic_update`."""

    batch: Batch
    targets: Targets | None
    values_BT: torch.Tensor | None
    stats: Stats = field(default_factory=dict)
    updated: bool = False  # the K critic steps already ran (advantages_after_critic_update)
    started: float = field(default_factory=time.perf_counter)  # (time/critic_s)


def critic_targets(
    trainer: Trainer, trajectories: Sequence[Trajectory], *, train_actor: bool = True
) -> tuple[torch.Tensor | None, CriticPending]:
    """The critic group's first half: the actor's advantages (CPU, ``[B, T]``;
    None when the values were NaN/inf, so nothing trains) and what the update needs."""
    trainer.bad.begin_step()
    batch = trainer.prepare(trajectories)
    values_BT = trainer.values(batch)
    targets = trainer.targets(batch, values_BT, trainer.running_mean)
    pending = CriticPending(batch, targets, values_BT)
    if targets is None:
        return None, pending
    if trainer.algo.advantages_after_critic_update and train_actor:
        pending.stats = _update(trainer, pending)
        pending.updated = True
        values = trainer.values(batch)
        pending.targets = targets = trainer.targets(batch, values, None, before_update=False)
        if targets is None:
            return None, pending
    return targets.advantages_BT.detach().cpu(), pending


def critic_update(trainer: Trainer, pending: CriticPending) -> Stats:
    """The critic group's second half: its K steps (unless done already), the
    step's bad-value count, and the batch statistics."""
    stats = pending.stats
    if not pending.updated and pending.targets is not None:
        stats = _update(trainer, pending)
    trainer.bad.end_step()
    stats["time/critic_s"] = trainer.since(pending.started)
    return to_cpu(stats | trainer.batch_stats(pending.batch, pending.targets))


def actor_update(
    trainer: Trainer, trajectories: Sequence[Trajectory], advantages_BT: torch.Tensor
) -> Stats:
    """The actor group's step on the critic group's advantages."""
    trainer.bad.begin_step()
    t0 = time.perf_counter()
    batch = trainer.prepare(trajectories)
    stats = trainer.update_actor(batch, advantages_BT.to(trainer.device))
    stats["time/actor_s"] = trainer.since(t0)
    trainer.bad.end_step()
    return to_cpu(stats | trainer.batch_stats(batch, None))


def merge_stats(critic: dict[str, float], actor: dict[str, float] | None) -> dict[str, float]:
    """One step's metrics from the two groups: the critic's batch statistics
    and the actor's losses; skipped steps added, the longest bad run of the two."""
    if actor is None:
        return critic
    out = critic | {k: v for k, v in actor.items() if not k.startswith("train/")}
    skipped, bad_run = "train/skipped_steps", "train/consecutive_bad_steps"
    out[skipped] = critic.get(skipped, 0.0) + actor.get(skipped, 0.0)
    out[bad_run] = max(critic.get(bad_run, 0.0), actor.get(bad_run, 0.0))
    out["critic/skipped_steps"] = critic.get("critic/skipped_steps", 0.0)
    return out


def _update(trainer: Trainer, pending: CriticPending) -> Stats:
    targets = pending.targets
    if targets is None or targets.returns_BT is None:
        return {}
    return trainer.update_critic(pending.batch, targets, pending.values_BT)
