"""Hypothesis properties of the policy and value losses (float64, small batches).

Float64 inputs keep float64 arithmetic inside the losses, so the references
below, written with the same elementary operations, match to rounding.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sao.algo.losses import (
    REDUCTIONS,
    aggregate_denom,
    cispo_loss,
    dis_loss,
    gspo_loss,
    ppo_clip_loss,
    value_loss,
)

F64 = torch.float64
SETTINGS = settings(max_examples=100, deadline=None)


@dataclass
class Batch:
    logp: torch.Tensor  # [B, T]
    ref: torch.Tensor  # rollout / old log-probabilities, [B, T]
    adv: torch.Tensor
    mask: torch.Tensor  # bool, at least one True

    def leaf(self) -> torch.Tensor:
        return self.logp.clone().requires_grad_()

    def ratio(self) -> torch.Tensor:
        return torch.exp(self.logp - self.ref)


# Advantages are 0 or at least 1e-6 in size, so r·A/N never underflows.
ADV = st.one_of(st.just(0.0), st.floats(1e-6, 5.0), st.floats(-5.0, -1e-6))


def _floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_subnormal=False)


@st.composite
def batches(draw: st.DrawFn, max_b: int = 4, max_t: int = 6) -> Batch:
    B, T = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    n = B * T

    def grid(elements: st.SearchStrategy, dtype: torch.dtype = F64) -> torch.Tensor:
        values = draw(st.lists(elements, min_size=n, max_size=n))
        return torch.tensor(values, dtype=dtype).reshape(B, T)

    logp = grid(_floats(-10.0, 0.0))
    log_ratio = grid(_floats(-3.0, 3.0))
    mask = grid(st.booleans(), torch.bool)
    assume(bool(mask.any()))
    return Batch(logp=logp, ref=logp - log_ratio, adv=grid(ADV), mask=mask)


EPS = st.tuples(st.sampled_from([0.2, 0.3, 0.5, 0.8]), st.sampled_from([0.28, 1.0, 3.0, 5.0]))


# ---------------------------------------------------------------- zero advantage


@pytest.mark.parametrize(
    "loss_fn",
    [
        dis_loss,
        ppo_clip_loss,
        lambda *a: ppo_clip_loss(*a, dual_clip=3.0),
        cispo_loss,
        gspo_loss,
    ],
)
@SETTINGS
@given(b=batches())
def test_zero_advantage_gives_zero_gradient(loss_fn: Callable, b: Batch) -> None:
    logp = b.leaf()
    loss, _ = loss_fn(logp, b.ref, torch.zeros_like(b.adv), b.mask)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))


# ---------------------------------------------------------------- DIS


@SETTINGS
@given(b=batches(), eps=EPS)
def test_dis_gradient_is_keep_r_a_over_n(b: Batch, eps: tuple[float, float]) -> None:
    logp = b.leaf()
    loss, _ = dis_loss(logp, b.ref, b.adv, b.mask, eps_low=eps[0], eps_high=eps[1])
    loss.backward()
    r = b.ratio()
    keep = b.mask & (r > 1 - eps[0]) & (r < 1 + eps[1])
    expected = torch.where(keep, r * b.adv, 0.0) / b.mask.sum()
    torch.testing.assert_close(-logp.grad, expected, rtol=1e-12, atol=1e-300)
    # Outside the band: exactly zero, whatever the sign of A.
    assert bool((logp.grad[~keep] == 0).all())


@SETTINGS
@given(b=batches(), eps=EPS, data=st.data())
def test_dis_drops_tokens_exactly_at_the_band_edges(
    b: Batch, eps: tuple[float, float], data: st.DataObject
) -> None:
    # float32, as in training: edges 1 - eps_low and 1 + eps_high in float32.
    edges = torch.tensor([1 - eps[0], 1 + eps[1]], dtype=torch.float32)
    assume(bool((torch.exp(torch.log(edges)) == edges).all()))  # edge representable as exp(log)
    which = torch.tensor(
        data.draw(
            st.lists(st.sampled_from([-1, 0, 1]), min_size=b.mask.numel(), max_size=b.mask.numel())
        )
    ).reshape(b.mask.shape)
    at_edge = which >= 0
    assume(bool((at_edge & b.mask).any()))
    ref = torch.where(at_edge, 0.0, b.ref).float()
    logp = torch.where(at_edge, torch.log(edges)[which.clamp(min=0)], b.logp.float())
    logp.requires_grad_()
    adv = torch.where(at_edge, 1.0, b.adv).float()  # nonzero, so a kept edge would show
    loss, stats = dis_loss(logp, ref, adv, b.mask, eps_low=eps[0], eps_high=eps[1])
    loss.backward()
    assert bool((logp.grad[at_edge] == 0).all())
    n_edge = (at_edge & b.mask).sum() / b.mask.sum()
    assert stats["dis/masked_frac"].item() >= n_edge.item() - 1e-6


# ---------------------------------------------------------------- PPO


def textbook_ppo(b: Batch, eps_low: float, eps_high: float, dual_clip: float | None):
    """Piecewise PPO objective and d(objective)/d(logp), token by token."""
    r, a = b.ratio(), b.adv
    # A >= 0: min(r, 1 + eps_high)·A, gradient r·A iff r < 1 + eps_high.
    # A <  0: max(r, 1 - eps_low)·A,  gradient r·A iff r > 1 - eps_low
    #         (and, with a dual clip c, only while r < c: the objective is max(.., c·A)).
    upper = torch.full_like(r, float("inf")) if dual_clip is None else torch.full_like(r, dual_clip)
    obj_pos = torch.minimum(r, torch.tensor(1 + eps_high, dtype=F64)) * a
    obj_neg = torch.minimum(torch.maximum(r, torch.tensor(1 - eps_low, dtype=F64)), upper) * a
    free_pos = r < 1 + eps_high
    free_neg = (r > 1 - eps_low) & (r < upper)
    obj = torch.where(a >= 0, obj_pos, obj_neg)
    grad = torch.where(torch.where(a >= 0, free_pos, free_neg), r * a, 0.0)
    n = b.mask.sum()
    return obj[b.mask].sum() / n, torch.where(b.mask, grad, 0.0) / n


@SETTINGS
@given(b=batches(), eps=EPS, dual_clip=st.sampled_from([None, 1.5, 3.0]))
def test_ppo_matches_textbook_piecewise_form(
    b: Batch, eps: tuple[float, float], dual_clip: float | None
) -> None:
    r = b.ratio()
    # The piecewise gradient is one-sided at the kinks; keep away from them.
    kinks = [1 - eps[0], 1 + eps[1]] + ([dual_clip] if dual_clip else [])
    assume(all(bool(((r - k).abs() > 1e-9).all()) for k in kinks))
    logp = b.leaf()
    loss, _ = ppo_clip_loss(
        logp, b.ref, b.adv, b.mask, eps_low=eps[0], eps_high=eps[1], dual_clip=dual_clip
    )
    loss.backward()
    obj, grad = textbook_ppo(b, eps[0], eps[1], dual_clip)
    torch.testing.assert_close(loss.detach(), -obj, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(-logp.grad, grad, rtol=1e-12, atol=1e-300)


# ---------------------------------------------------------------- CISPO


@SETTINGS
@given(b=batches(), eps=EPS)
def test_cispo_gradient_never_zero_where_advantage_nonzero(
    b: Batch, eps: tuple[float, float]
) -> None:
    for eps_low in (1.0, eps[0]):
        logp = b.leaf()
        cispo_loss(logp, b.ref, b.adv, b.mask, eps_low=eps_low, eps_high=eps[1])[0].backward()
        live = b.mask & (b.adv != 0)
        assert bool((logp.grad[live] != 0).all())
        assert bool((logp.grad[~live] == 0).all())


# ---------------------------------------------------------------- micro-batching


def _split_rows(mask: torch.Tensor, cuts: list[int]) -> list[slice]:
    bounds = [0, *sorted(set(cuts)), mask.shape[0]]
    return [slice(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]


LOSSES_WITH_REDUCTION: dict[str, Callable] = {
    "dis": lambda b, lp, s, **kw: dis_loss(lp, b.ref[s], b.adv[s], b.mask[s], **kw),
    "ppo": lambda b, lp, s, **kw: ppo_clip_loss(
        lp, b.ref[s], b.adv[s], b.mask[s], dual_clip=2.0, **kw
    ),
    "cispo": lambda b, lp, s, **kw: cispo_loss(lp, b.ref[s], b.adv[s], b.mask[s], **kw),
    "value": lambda b, lp, s, **kw: value_loss(lp, b.adv[s], b.mask[s], **kw),
}


@pytest.mark.parametrize("name", sorted(LOSSES_WITH_REDUCTION))
@pytest.mark.parametrize("reduction", REDUCTIONS)
@SETTINGS
@given(b=batches(max_b=6), cuts=st.lists(st.integers(1, 5), max_size=3))
def test_micro_batches_with_denom_sum_to_full_batch_gradient(
    name: str, reduction: str, b: Batch, cuts: list[int]
) -> None:
    parts = _split_rows(b.mask, [c for c in cuts if c < b.mask.shape[0]])
    assume(all(bool(b.mask[s].any()) for s in parts))  # every micro-batch has an action token
    fn = LOSSES_WITH_REDUCTION[name]
    full = b.leaf()
    fn(b, full, slice(None), reduction=reduction)[0].backward()
    denom = aggregate_denom(b.mask, reduction)
    micro = b.leaf()
    total = sum(fn(b, micro[s], s, reduction=reduction, denom=denom)[0] for s in parts)
    total.backward()
    torch.testing.assert_close(micro.grad, full.grad, rtol=1e-10, atol=1e-14)


@SETTINGS
@given(b=batches(max_b=6), cuts=st.lists(st.integers(1, 5), max_size=3))
def test_gspo_micro_batches_with_denom_sum_to_full_batch_gradient(
    b: Batch, cuts: list[int]
) -> None:
    parts = _split_rows(b.mask, [c for c in cuts if c < b.mask.shape[0]])
    assume(all(bool(b.mask[s].any()) for s in parts))
    eps = dict(eps_low=0.2, eps_high=0.3)  # wide enough that some rows keep a gradient
    full = b.leaf()
    gspo_loss(full, b.ref, b.adv, b.mask, **eps)[0].backward()
    denom = aggregate_denom(b.mask, "seq_mean_token_mean")
    micro = b.leaf()
    sum(
        gspo_loss(micro[s], b.ref[s], b.adv[s], b.mask[s], denom=denom, **eps)[0] for s in parts
    ).backward()
    torch.testing.assert_close(micro.grad, full.grad, rtol=1e-10, atol=1e-14)
