"""Off-policy control: how far rollouts may run ahead of the trainer."""

from __future__ import annotations

from dataclasses import dataclass

from sao.types import Trajectory


@dataclass
class StalenessGate:
    """Bounds how stale a trajectory may be, in two places.

    Let ``v`` be the trainer's current weight version (number of actor steps
    published), ``s`` the number of batches the trainer has consumed (``s = v``
    except during critic-only warm-up, which consumes batches without
    publishing), ``B`` the batch size in trajectories and ``L = max_lag``.

    * Admission (before an episode starts; AReaL-style capacity): a new
      episode may start only while ``started - rejected + n <= (s + L + 1) * B``
      for ``n`` new episodes (a group starts whole),
      i.e. at most ``L + 1`` batches are generated ahead of the trainer.
      ``started`` counts episodes ever started; ``rejected`` those that will
      never be trained (dropped as stale, or filtered, e.g. by DAPO's dynamic
      sampling), so they give their capacity back.
    * Drop (when a finished episode is taken for training; GLM-5 style):
      drop it iff ``v - min(version of its action tokens) > L``.

    Synchronous training is ``max_lag = 0``: exactly one batch is generated
    per version and the trainer waits for it; there is no second code path.
    """

    max_lag: int
    batch_size: int
    started: int = 0
    rejected: int = 0
    dropped: int = 0

    def __post_init__(self) -> None:
        if self.max_lag < 0:
            raise ValueError(f"max_lag must be >= 0, got {self.max_lag}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    def can_start(self, consumed_batches: int, n: int = 1, *, capacity: int | None = None) -> bool:
        """True when ``n`` more episodes may start, the trainer having consumed
        ``consumed_batches`` batches. ``capacity``: a smaller limit on episodes
        started (less rejected) than the bound's ``(s + L + 1) * B``, e.g. from
        the just-in-time admission of :mod:`sao.runtime.admission`."""
        bound = (consumed_batches + self.max_lag + 1) * self.batch_size
        limit = bound if capacity is None else min(capacity, bound)
        return self.started - self.rejected + n <= limit

    def start(self, n: int = 1) -> None:
        """Record ``n`` episodes started."""
        self.started += n

    def reject(self, n: int = 1) -> None:
        """Record ``n`` finished episodes that will not be trained on."""
        self.rejected += n

    def lag(self, trajectory: Trajectory, version: int) -> int:
        """Versions between the trainer and the oldest action token (0 if none)."""
        oldest = trajectory.min_version
        return 0 if oldest < 0 else version - oldest

    def is_fresh(self, trajectory: Trajectory, version: int) -> bool:
        """True to train on it; False (and counted in ``dropped``) when too stale."""
        if self.lag(trajectory, version) > self.max_lag:
            self.dropped += 1
            self.reject()
            return False
        return True

    def describe(self, *, in_flight: int, kv_kept: bool, admission: str = "static") -> str:
        """One line: the worst-case policy lag this configuration allows, and
        every knob that contributes to it (printed at start-up)."""
        L, B = self.max_lag, self.batch_size
        kv = (
            "; tokens sampled after an in-flight update attend to keys computed by earlier "
            "versions (rollout.recompute_kv_on_update=false)"
            if kv_kept and L > 0
            else ""
        )
        if admission == "fixed":
            return (
                f"fixed policy lag: every batch is exactly {L} version(s) old, the first {L} "
                f"step(s) less (runtime.admission=fixed, a measurement device: the trainer "
                f"waits for the rollouts of batch s + {L + 1} before each publish, so no "
                f"episode spans a weight update); batch {B}, rollout.in_flight {in_flight}"
            )
        when = (
            "as late as keeps the trainer fed (runtime.admission=jit)"
            if admission == "jit" and L > 0
            else "as early as allowed (runtime.admission=static)"
        )
        return (
            f"worst-case policy lag: {L} version(s) (runtime.max_lag; older trajectories are "
            f"dropped); up to (max_lag + 1) x batch {B} = {(L + 1) * B} episodes started ahead "
            f"of the trainer, {when}, {min(in_flight, (L + 1) * B)} running at once "
            f"(rollout.in_flight {in_flight}); 1 actor step per batch{kv}"
        )
