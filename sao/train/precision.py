"""Float32 master weights for models kept in bfloat16 (mixed-precision training).

The model's weights and gradients stay in its own dtype (bf16 on a GPU); the
optimizer steps float32 copies of them, so AdamW's moments are float32 and an
update far below the weight's bf16 resolution is still accumulated
(Micikevicius et al. 2018, "Mixed Precision Training", section 3.1). Without
it, AdamW at the paper's actor LR of 1e-6 leaves almost every bf16 weight
unchanged: a weight of size 0.02 has a bf16 spacing of ~1.2e-4, so an update of
1e-6 rounds back to the same weight.

A float32 parameter is its own master (no copy): on CPU in float32 this class
changes nothing, and the trainer runs the same code in both cases. The sharded
trainer is such a case too: :func:`sao.train.sharded.shard` keeps FSDP2's
shards in float32 and gathers them in bf16 for compute, so each float32 shard
(a DTensor) is its own master.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["MasterWeights"]


class MasterWeights:
    """Float32 masters of ``params``; the optimizer is built on :attr:`params`.

    Per step: backward fills the model's gradients; :meth:`load_grads` moves
    them onto the masters (as float32) and frees the model's; the optimizer
    steps the masters; :meth:`store` writes them back into the model weights.
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.model_params = list(params)
        self.params: list[nn.Parameter] = [
            p if p.dtype == torch.float32 else nn.Parameter(p.detach().float())
            for p in self.model_params
        ]

    def _pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        return [(p, m) for p, m in zip(self.model_params, self.params, strict=True) if p is not m]

    def load_grads(self) -> list[nn.Parameter]:
        """Move the model's gradients onto the masters; returns the masters that have one."""
        for p, m in self._pairs():
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        return [m for m in self.params if m.grad is not None]

    @torch.no_grad()
    def store(self) -> None:
        """Copy the masters into the model's weights (rounded to the model's dtype)."""
        for p, m in self._pairs():
            p.copy_(m)

    def state_dict(self) -> list[torch.Tensor]:
        """The masters that are copies (none for a float32 model), for checkpoints."""
        return [m.detach().clone() for _, m in self._pairs()]

    @torch.no_grad()
    def load_state_dict(self, state: list[torch.Tensor]) -> None:
        """Restore masters saved by :meth:`state_dict`; the model weights follow."""
        pairs = self._pairs()
        if len(state) != len(pairs):
            raise ValueError(
                f"saved master weights hold {len(state)} tensors, this model has {len(pairs)} "
                "low-precision parameters (was the checkpoint written with another model.dtype?)"
            )
        for (_, m), saved in zip(pairs, state, strict=True):
            m.copy_(saved)
        self.store()
