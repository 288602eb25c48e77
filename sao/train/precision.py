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

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["MasterWeights", "adamw", "adamw_nonfinite", "adamw_step_bound"]


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


def adamw(params: list[nn.Parameter], lr: float) -> torch.optim.AdamW:
    """AdamW over ``params``, torch's fused kernel where they are plain tensors:
    one pass over each weight instead of the ``foreach`` kernels' many (on the
    CPU 0.36 s against 18 s a step for SmolLM2-135M's weights, BENCHMARKS.md,
    "Trainer step: where the time goes"). FSDP2's shards (DTensors) keep the
    ``foreach`` implementation."""
    fused = bool(params) and not any(isinstance(p, DTensor) for p in params)
    return torch.optim.AdamW(params, lr=lr, fused=fused or None)


def warmup(optim: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear learning-rate warm-up over ``steps`` applied updates (0 or 1: none):
    update ``s`` (from 0) runs at ``min(1, (s + 1) / steps)`` of the rate. Adam's
    first updates move every weight by about the full rate whatever its gradient
    (its moment estimates hold one or two gradients), so a warm-up keeps them small."""
    warm = max(steps, 1)
    return torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / warm))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2); a plain tensor as is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _check_adamw(optim: torch.optim.Optimizer) -> None:
    if not isinstance(optim, torch.optim.AdamW) or any(g["amsgrad"] for g in optim.param_groups):
        raise TypeError("only a plain torch.optim.AdamW (amsgrad=False) is supported")


@torch.no_grad()
def adamw_step_bound(optim: torch.optim.Optimizer) -> torch.Tensor:
    """An upper bound of ``max |p|`` after the next ``optim.step()``, over this
    rank's shards of the parameters that have a gradient (0-dim float32 on their
    device; inf where no bound is known). It costs one fused read of the
    parameters; only when it comes near float32's range is the exact (and ~2x
    optimizer-step) :func:`adamw_nonfinite` needed.

    With moments that Adam built from zero, Cauchy-Schwarz bounds the step
    (``b1^2 < b2``; ``k`` counts steps back)::

        |m| = (1 - b1) |sum_k b1^k g_k| <= (1 - b1) sqrt(sum_k (b1^2 / b2)^k) sqrt(sum_k b2^k g_k^2)
            <= K sqrt(v),    K = (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2))   (7.3 for 0.9, 0.999)
        |p'| <= |p| |1 - lr wd| + lr / (1 - b1^t) * sqrt(1 - b2^t) * K

    (the bound uses the 2-norm of all of a group's weights for ``max |p|``).
    """
    _check_adamw(optim)
    bounds: list[torch.Tensor] = []
    for group in optim.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        b1, b2 = (float(b) for b in group["betas"])
        steps = {float(optim.state[p]["step"]) if optim.state.get(p) else 0.0 for p in params}
        factor = max(math.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1)) for t in steps)
        K = (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2)) if b1 * b1 < b2 else math.inf
        # max |p| <= ||p||_2, whose fused kernel reads the weights ~15x faster than the
        # inf-norm's; a norm that overflows (weights past 1e19) only sends the check to
        # the exact prediction
        largest = torch.nn.utils.get_total_norm([_local(p) for p in params])
        bounds.append(largest * abs(1 - lr * wd) + lr * factor * K)  # (a float: inf when huge)
    if not bounds:  # no gradient anywhere: nothing would change
        first = next((p for g in optim.param_groups for p in g["params"]), None)
        return torch.zeros((), device=None if first is None else first.device)
    return torch.stack(bounds).max()


@torch.no_grad()
def adamw_nonfinite(optim: torch.optim.Optimizer) -> torch.Tensor:
    """How many parameter entries the next ``optim.step()`` would make NaN or inf
    (0-dim float32 on the parameters' device; this rank's shards only, so sum it
    over the ranks), without touching the parameters or the optimizer state.

    Each parameter's update is recomputed out of place with torch's AdamW formula
    (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization", Algorithm 2,
    in torch's arrangement)::

        m = beta1 * m + (1 - beta1) * g            v = beta2 * v + (1 - beta2) * g^2
        p' = p * (1 - lr * wd) - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)

    Why predict instead of stepping and undoing: the step is in place and cannot be
    undone once a parameter is inf (inf - inf), and a copy of parameters plus both
    moments before every step would cost three times the model's float32 size. The
    prediction costs one elementwise pass and one parameter's worth of temporaries.
    A finite gradient can still overflow: with a huge learning rate the decoupled
    decay multiplies every weight by ``1 - lr * wd`` (-1e7 at lr 1e9: inf within
    six steps), or ``lr / (1 - beta1^t)`` itself exceeds float32's range, where
    torch's step raises instead of producing inf; both count as non-finite here.
    """
    _check_adamw(optim)
    counts: list[torch.Tensor] = []
    for group in optim.param_groups:
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        beta1, beta2 = (float(b) for b in group["betas"])
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optim.state.get(p, {})
            t = float(state["step"]) + 1 if state else 1.0
            g = _local(p.grad)
            if state:  # (maximize flips the sign of the update: the same finiteness)
                m = torch.lerp(_local(state["exp_avg"]), g, 1 - beta1)
                v = _local(state["exp_avg_sq"]).mul(beta2).addcmul_(g, g, value=1 - beta2)
            else:  # the first step: both moments start at zero
                m, v = g.mul(1 - beta1), g.square().mul_(1 - beta2)
            decay, step_size = 1 - lr * wd, lr / (1 - beta1**t)
            if max(abs(decay), step_size) > torch.finfo(p.dtype).max:
                # torch's step raises here ("value cannot be converted to type float
                # without overflow"): a scalar of the update is not representable
                counts.append(torch.full((), float(g.numel()), device=g.device))
                continue
            denom = v.sqrt_().div_(math.sqrt(1 - beta2**t)).add_(eps)
            new = _local(p).mul(decay).addcdiv_(m, denom, value=-step_size)
            counts.append(torch.isfinite(new).logical_not_().sum().float())
    if not counts:  # no gradient anywhere: nothing would change
        first = next((p for g in optim.param_groups for p in g["params"]), None)
        return torch.zeros((), device=None if first is None else first.device)
    return torch.stack(counts).sum()
