"""Float32 master weights: small AdamW updates of a bf16 model are not lost."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sao.train.precision import MasterWeights


def adam_steps(param: nn.Parameter, steps: int, lr: float = 1e-6) -> MasterWeights:
    weights = MasterWeights([param])
    optim = torch.optim.AdamW(weights.params, lr=lr, weight_decay=0.0)
    sign = torch.ones_like(param)
    for _ in range(steps):
        param.grad = sign.clone()
        weights.load_grads()
        optim.step()
        weights.store()
    return weights


def test_bf16_updates_below_resolution_accumulate_in_the_masters() -> None:
    # 0.02 lies in [2^-6, 2^-5): bf16 spacing 2^-13 ~ 1.2e-4, so one Adam step of
    # lr = 1e-6 rounds back to 0.02; 100 steps move the master by 100 * 1e-6 = 1e-4.
    start = torch.full((4,), 0.02)
    direct = nn.Parameter(start.bfloat16())
    optim = torch.optim.AdamW([direct], lr=1e-6, weight_decay=0.0)
    for _ in range(100):
        direct.grad = torch.ones_like(direct)
        optim.step()
    assert torch.equal(direct.detach(), start.bfloat16())  # plain bf16 AdamW: no change at all

    param = nn.Parameter(start.bfloat16())
    weights = adam_steps(param, 100)
    master = weights.params[0]
    assert master.dtype == torch.float32 and param.dtype == torch.bfloat16
    assert torch.allclose(master.detach(), start.bfloat16().float() - 1e-4, atol=1e-7)
    assert torch.equal(param.detach(), master.detach().bfloat16())  # the model follows
    assert param.grad is None  # the gradient was moved, not copied


def test_float32_parameters_are_their_own_masters() -> None:
    param = nn.Parameter(torch.zeros(3))
    weights = adam_steps(param, 2)
    assert weights.params[0] is param and weights.state_dict() == []


def test_masters_round_trip_through_state_dict() -> None:
    param = nn.Parameter(torch.full((4,), 0.02).bfloat16())
    saved = adam_steps(param, 50).state_dict()
    fresh = MasterWeights([param])  # seeded from the (rounded) bf16 weights
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.params[0].detach(), saved[0])
    with pytest.raises(ValueError, match=r"another model\.dtype"):
        fresh.load_state_dict([])
