"""NaN/inf on the way to an update: which loss input went bad (named as a
stop message names it), the per-update record of bad micro-batches and
losses, and the error that stops a run after ``max_bad_steps`` bad steps in a
row (:mod:`sao.train.trainer` skips each such update)."""

from __future__ import annotations

import torch

__all__ = ["WHAT", "BadSteps", "Guard", "NonFiniteError", "nonfinite"]


class NonFiniteError(RuntimeError):
    """``max_bad_steps`` consecutive steps had a NaN/inf value; every update they
    would have made was skipped, so the models hold their last good weights."""


WHAT = {
    "logp_BT": "log-probabilities",
    "rollout_logp_BT": "rollout log-probabilities",
    "old_logp_BT": "old-policy log-probabilities",
    "advantages_BT": "advantages",
    "values_BT": "values",
    "returns_BT": "returns",
    "old_values_BT": "old values",
}
"""Loss inputs by name, as a stop message names them."""


class Guard:
    """What one optimizer update met on this rank: micro-batches whose loss
    inputs were NaN/inf on an action token (their loss is not computed: the loss
    functions reject such inputs), and losses that came out NaN/inf (a device
    tensor, read once with the gradient norm in ``Trainer._apply``)."""

    def __init__(self, device: torch.device) -> None:
        self.bad_inputs = torch.zeros((), device=device)
        self.bad_losses = torch.zeros((), device=device)
        self.what: str | None = None  # the first NaN/inf input seen here

    def usable(self, mask_BT: torch.Tensor, **inputs: torch.Tensor | None) -> bool:
        """Whether a micro-batch's loss can be computed: it has an action token
        and its inputs are finite there (else it runs a zero backward)."""
        if not bool(mask_BT.any()):
            return False
        name = nonfinite(mask_BT, **inputs)
        if name is not None:
            self.bad_inputs += 1
            self.what = self.what or name
        return name is None

    def loss(self, loss: torch.Tensor) -> None:
        self.bad_losses += torch.isfinite(loss.detach()).logical_not()


def nonfinite(mask_BT: torch.Tensor, **tensors: torch.Tensor | None) -> str | None:
    """The stop-message name of the first tensor that is NaN/inf somewhere
    ``mask_BT`` is True; None when all are finite there (None tensors are
    skipped). One host sync."""
    given = {n: t for n, t in tensors.items() if t is not None}
    if not given:
        return None
    bad = torch.stack([(~torch.isfinite(t.detach()) & mask_BT).any() for t in given.values()])
    return next((WHAT.get(n, n) for n, b in zip(given, bad.tolist(), strict=True) if b), None)


class BadSteps:
    """Trainer steps in which the actor or the critic met a NaN/inf value: this
    step's findings (model -> what was not finite), the run of such steps in a
    row, and the count of all of them and per model. One good update of the
    critic must not hide a diverged actor, so they are counted per trainer step;
    every rank takes the same decisions, so every rank stops at the same step."""

    def __init__(self, max_bad_steps: int, lrs: dict[str, float]) -> None:
        self.max_bad_steps, self.lrs = max_bad_steps, lrs
        self.found: dict[str, str] = {}  # this step: model -> what was not finite
        self.in_a_row = 0
        self.total = 0
        self.per_model = {"actor": 0, "critic": 0}  # steps each model was bad in

    def begin_step(self) -> None:
        """Forget the last step's findings (a step that raised leaves them)."""
        self.found = {}

    def end_step(self) -> None:
        """Count this step if it was bad; after ``max_bad_steps`` in a row, stop
        the run (:class:`NonFiniteError`)."""
        found = self.found
        if not found:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        for model in found:
            self.per_model[model] += 1
        if self.in_a_row >= self.max_bad_steps:
            raise NonFiniteError(self._stop_message(found))

    def _stop_message(self, found: dict[str, str]) -> str:
        """What diverged, that the weights are the last good ones, which knobs to turn."""
        what = "; ".join(f"{m}: NaN/inf {w}" for m, w in found.items())
        knobs = " or ".join(f"train.{m}_lr (now {self.lrs[m]:g})" for m in found)
        return (
            f"{self.in_a_row} consecutive steps had NaN/inf values "
            f"(train.max_bad_steps={self.max_bad_steps}); last one: {what}. Every such "
            "update was skipped, so the models keep their last good (finite) weights. "
            f"Lower {knobs}, or raise train.max_bad_steps"
        )

    def stats(self) -> dict[str, float]:
        return {
            "train/skipped_steps": self.total,
            "train/consecutive_bad_steps": self.in_a_row,
            "actor/skipped_steps": self.per_model["actor"],
            "critic/skipped_steps": self.per_model["critic"],
        }

    def state_dict(self) -> dict[str, object]:
        return {"skipped_steps": self.total, "skipped_per_model": dict(self.per_model)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.total = int(state.get("skipped_steps", 0))  # type: ignore[call-overload]
        self.per_model |= state.get("skipped_per_model") or {}  # type: ignore[call-overload]
