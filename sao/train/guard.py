"""NaN/inf on the way to an update: which loss input went bad (named as a
stop message names it), the per-update record of bad micro-batches and
losses, and the error that stops a run after ``max_bad_steps`` bad steps in a
row (:mod:`sao.train.trainer` skips each such update)."""

from __future__ import annotations

import torch

__all__ = ["WHAT", "Guard", "NonFiniteError", "nonfinite"]


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
