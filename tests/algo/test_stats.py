"""Numeric and property tests for sao.algo.stats (hand-worked, 3-5 elements)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sao.algo.stats import (
    effective_sample_size,
    explained_variance,
    kl_k1,
    kl_k3,
    masked_fractions,
    masked_mean,
    masked_sum,
    masked_var,
)

NAN = float("nan")


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.float32)


def m(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.bool)


# ---------------------------------------------------------------- masked moments


def test_masked_sum_mean_var_hand_worked() -> None:
    # Kept: 1, 2, 4, 6 (the NaN and the 3 are padding).
    # sum = 13; mean = 13 / 4 = 3.25
    # deviations^2: 5.0625, 1.5625, 0.5625, 7.5625 -> 14.75 / 4 = 3.6875 (population variance)
    x = t([1.0, 2.0, 3.0], [4.0, NAN, 6.0])
    mask = m([1, 1, 0], [1, 0, 1])
    assert masked_sum(x, mask).item() == pytest.approx(13.0)
    assert masked_mean(x, mask).item() == pytest.approx(3.25)
    assert masked_var(x, mask).item() == pytest.approx(3.6875)


def test_masked_mean_gradient_ignores_nan_padding() -> None:
    # d mean / dx = 1/3 on the three kept entries, 0 (not NaN) on padding.
    x = t([1.0, NAN, 3.0], [5.0, 7.0, NAN]).requires_grad_()
    mask = m([1, 0, 1], [1, 0, 0])
    masked_var(x, mask).backward()  # exercises the centred path too
    assert torch.isfinite(x.grad).all()
    x.grad = None
    masked_mean(x, mask).backward()
    torch.testing.assert_close(x.grad, t([1 / 3, 0.0, 1 / 3], [1 / 3, 0.0, 0.0]))


def test_masked_sum_of_empty_mask_is_zero_but_mean_raises() -> None:
    x = t([1.0, 2.0])
    empty = m([0, 0])
    assert masked_sum(x, empty).item() == 0.0
    with pytest.raises(ValueError, match="no True entry"):
        masked_mean(x, empty)
    with pytest.raises(ValueError, match="no True entry"):
        masked_var(x, empty)


def test_masked_mean_of_bf16_is_computed_in_float32() -> None:
    x = torch.full((1, 4), 1.0, dtype=torch.bfloat16)
    out = masked_mean(x, m([1, 1, 1, 1]))
    assert out.dtype == torch.float32 and out.item() == 1.0


# ---------------------------------------------------------------- explained variance


def test_explained_variance_hand_worked() -> None:
    # R = 1, 2, 3, 4 -> mean 2.5, Var(R) = (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25
    # V = 1, 2, 3, 5 -> R - V = 0, 0, 0, -1, mean -0.25,
    #   Var = (3 * 0.0625 + 0.5625) / 4 = 0.1875
    # EV = 1 - 0.1875 / 1.25 = 0.85
    returns = t([1.0, 2.0, 3.0, 4.0, 99.0])
    values = t([1.0, 2.0, 3.0, 5.0, -99.0])
    mask = m([1, 1, 1, 1, 0])
    assert explained_variance(values, returns, mask).item() == pytest.approx(0.85)


def test_explained_variance_limits() -> None:
    returns = t([1.0, 2.0, 4.0])
    mask = m([1, 1, 1])
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    mean = torch.full_like(returns, 7.0 / 3.0)
    assert explained_variance(mean, returns, mask).item() == pytest.approx(0.0, abs=1e-6)


def test_explained_variance_is_nan_when_returns_are_constant() -> None:
    # Var(R) = 0: undefined, reported as NaN (documented), never an exception.
    ev = explained_variance(t([0.1, 0.5, 2.0]), t([1.0, 1.0, 1.0]), m([1, 1, 1]))
    assert math.isnan(ev.item())


# ---------------------------------------------------------------- KL estimators


def test_kl_k1_k3_hand_worked() -> None:
    # log r = logp - ref = 0.5, 0, -ln 2 (r = p/q = e^0.5, 1, 0.5)
    # k1 = mean(log q - log p) = mean(-0.5, 0, ln 2) = 0.193147 / 3 = 0.0643824
    # k3 = mean((r - 1) - log r) = (0.148721 + 0 + 0.193147) / 3 = 0.113956
    ref = t([-1.0, -2.0, -0.5, 5.0])
    logp = ref + t([0.5, 0.0, -math.log(2.0), 123.0])
    mask = m([1, 1, 1, 0])
    assert kl_k1(logp, ref, mask).item() == pytest.approx(0.0643824, abs=1e-6)
    assert kl_k3(logp, ref, mask).item() == pytest.approx(0.113956, abs=1e-6)


def test_kl_direction_is_kl_of_sampler_to_trainer() -> None:
    # Tokens drawn from q (the sampler); both estimators converge to KL(q || p).
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    p = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    kl_qp = float((q * (q / p).log()).sum())  # 0.4003; KL(p || q) = 0.3696 differs
    x = torch.multinomial(q, 200_000, replacement=True, generator=gen)[None, :]
    mask = torch.ones_like(x, dtype=torch.bool)
    assert kl_k1(p.log()[x], q.log()[x], mask).item() == pytest.approx(kl_qp, abs=0.01)
    assert kl_k3(p.log()[x], q.log()[x], mask).item() == pytest.approx(kl_qp, abs=0.01)


# ---------------------------------------------------------------- ESS


def test_effective_sample_size_hand_worked() -> None:
    # w = 1, 1, 2 (the 4th is padding): (Σw)^2 / (n Σw^2) = 16 / (3 * 6) = 0.888...
    log_w = t([0.0, 0.0, math.log(2.0), 50.0])
    assert effective_sample_size(log_w, m([1, 1, 1, 0])).item() == pytest.approx(8 / 9)


def test_effective_sample_size_is_stable_for_huge_and_tiny_weights() -> None:
    mask = m([1, 1, 1])
    assert effective_sample_size(t([1000.0, 1000.0, 1000.0]), mask).item() == pytest.approx(1.0)
    assert effective_sample_size(t([-1000.0, -1000.0, -1000.0]), mask).item() == pytest.approx(1.0)
    # One weight dominates: ESS -> 1/n.
    assert effective_sample_size(t([0.0, 0.0, 200.0]), mask).item() == pytest.approx(1 / 3)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-30, 30, allow_subnormal=False), min_size=1, max_size=12),
    st.floats(-50, 50, allow_subnormal=False),
)
def test_ess_in_unit_interval_and_scale_invariant(log_w: list[float], shift: float) -> None:
    lw = torch.tensor(log_w, dtype=torch.float64)
    mask = torch.ones_like(lw, dtype=torch.bool)
    ess = effective_sample_size(lw, mask).item()
    assert 1 / len(log_w) - 1e-9 <= ess <= 1 + 1e-9
    assert effective_sample_size(lw + shift, mask).item() == pytest.approx(ess, rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-5, 5, allow_subnormal=False), min_size=1, max_size=12))
def test_k3_is_nonnegative(log_r: list[float]) -> None:
    lr = torch.tensor(log_r, dtype=torch.float64)
    mask = torch.ones_like(lr, dtype=torch.bool)
    assert kl_k3(lr, torch.zeros_like(lr), mask).item() >= 0.0


# ---------------------------------------------------------------- fractions


def test_masked_fractions_hand_worked_edges_count_as_masked() -> None:
    # band (0.7, 6.0): 0.5 and 0.7 are low (2/5), 6.0 and 7.0 are high (2/5); padding ignored.
    ratio = t([0.5, 0.7, 1.0, 6.0, 7.0, 0.1])
    low, high = masked_fractions(ratio, m([1, 1, 1, 1, 1, 0]), low=0.7, high=6.0)
    assert low.item() == pytest.approx(0.4)
    assert high.item() == pytest.approx(0.4)


# ---------------------------------------------------------------- bad input


def test_stats_reject_bad_input() -> None:
    x = t([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="shape"):
        masked_mean(x, m([1, 1]))
    with pytest.raises(ValueError, match="0/1"):
        masked_mean(x, torch.tensor([[0, 2, 1]]))
    with pytest.raises(ValueError, match="returns_BT"):
        explained_variance(x, t([1.0]), m([1, 1, 1]))
    with pytest.raises(ValueError, match="no True entry"):
        effective_sample_size(x, m([0, 0, 0]))


def test_explained_variance_is_nan_when_returns_are_constant_up_to_rounding() -> None:
    # Returns rebuilt as advantage + value (as GAE does) differ from 0 only by
    # float rounding: 0.1 + 0.2 - 0.3 != 0 in float32. EV is undefined there.
    values = torch.tensor([[0.1, 0.2, 0.3]])
    adv = -values
    returns = adv + values + torch.tensor([[0.0, 1e-8, -1e-8]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert torch.isnan(explained_variance(values, returns, mask))
