"""Hand-worked numeric tests, edge cases and bad-input errors for sao.algo.losses.

Every numeric case uses 3-5 tokens; the arithmetic is in the comment above it.
Losses are ``-objective``, so a gradient of the loss is minus the objective's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from sao.algo.losses import (
    REDUCTIONS,
    aggregate,
    aggregate_denom,
    cispo_loss,
    dis_loss,
    gspo_loss,
    icepop_mask,
    ppo_clip_loss,
    tis_weights,
    value_loss,
)

LN2 = math.log(2.0)
NAN = float("nan")


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.float32)


def m(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.bool)


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x.clone().requires_grad_()


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- aggregate


def test_aggregate_reductions_hand_worked() -> None:
    # Row 0 keeps 1, 2; row 1 keeps 4; row 2 has no action token (ignored).
    # token_mean               = (1 + 2 + 4) / 3           = 7/3
    # seq_mean_token_mean      = ((1 + 2)/2 + 4/1) / 2     = 2.75
    # seq_mean_token_sum_norm  = (1 + 2 + 4) / (2 rows * T=3) = 7/6
    x = t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, NAN, 9.0])
    mask = m([1, 1, 0], [1, 0, 0], [0, 0, 0])
    assert aggregate(x, mask).item() == pytest.approx(7 / 3)
    assert aggregate(x, mask, "seq_mean_token_mean").item() == pytest.approx(2.75)
    assert aggregate(x, mask, "seq_mean_token_sum_norm").item() == pytest.approx(7 / 6)
    # denom replaces the divisor: 7 / 7 = 1.
    assert aggregate(x, mask, denom=7.0).item() == pytest.approx(1.0)
    assert [aggregate_denom(mask, r) for r in REDUCTIONS] == [3.0, 2.0, 6.0]


def test_aggregate_rejects_unknown_reduction_and_bad_denom() -> None:
    x, mask = t([1.0, 2.0]), m([1, 1])
    with pytest.raises(ValueError, match=r"reduction must be one of 'token_mean'.*got 'mean'"):
        aggregate(x, mask, "mean")
    with pytest.raises(ValueError, match="denom"):
        aggregate(x, mask, denom=0.0)
    with pytest.raises(ValueError, match="reduction"):
        dis_loss(x, x, x, mask, reduction="sum")


# ---------------------------------------------------------------- DIS


def dis_case() -> tuple[torch.Tensor, ...]:
    # rollout_logp = -1 everywhere; log r = 0, ln .5, ln 2, ln 8 -> r = 1, 0.5, 2, 8.
    rollout = t([-1.0, -1.0, -1.0, -1.0])
    logp = leaf(rollout + t([0.0, -LN2, LN2, 3 * LN2]))
    adv = t([1.0, -2.0, 3.0, 1.0])
    return logp, rollout, adv, m([1, 1, 1, 1])


def test_dis_loss_hand_worked() -> None:
    # Band (0.7, 6.0): keep = 1, 0, 1, 0 (0.5 too low, 8 too high). N = 4.
    # loss = -(1·1·logp0 + 2·3·logp2) / 4 = -(-1 + 6·(-1 + ln 2)) / 4 = 0.710279
    # ∂loss/∂logp = -keep·r·A / N = -1/4, 0, -6/4, 0
    logp, rollout, adv, mask = dis_case()
    loss, stats = dis_loss(logp, rollout, adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx(0.710279, abs=1e-5)
    close(logp.grad, t([-0.25, 0.0, -1.5, 0.0]))
    # ratio mean (1 + .5 + 2 + 8)/4 = 2.875; k1 = mean(-log r) = -3 ln2 / 4 = -0.519860
    # k3 = mean(r - 1 - log r) = (0 + 0.193147 + 0.306853 + 4.920558) / 4 = 1.355140
    # ESS = (Σw)^2 / (n Σw^2) = 11.5^2 / (4 · 69.25) = 0.477437
    # masked: tokens 1 (A -2) and 3 (A 1): |A| 3 of 7 -> 0.428571; 1 of 4 tokens is
    # masked with a negative advantage
    expected = {
        "dis/masked_adv_share": 3 / 7,
        "dis/masked_neg_adv_frac": 0.25,
        "dis/masked_frac": 0.5,
        "dis/masked_low_frac": 0.25,
        "dis/masked_high_frac": 0.25,
        "dis/ratio_mean": 2.875,
        "dis/ratio_max": 8.0,
        "dis/ratio_min": 0.5,
        "dis/kl_k1": -0.519860,
        "dis/kl_k3": 1.355140,
        "dis/ess": 0.477437,
    }
    assert set(stats) == set(expected)
    for name, value in expected.items():
        assert stats[name].item() == pytest.approx(value, abs=1e-5), name
        assert stats[name].ndim == 0 and not stats[name].requires_grad


def test_dis_loss_coding_band_keeps_what_math_band_drops() -> None:
    # Coding band (0.2, 4.0) keeps r = 0.5 and still drops r = 8: grad = -(1, -1, 6, 0)/4.
    logp, rollout, adv, mask = dis_case()
    dis_loss(logp, rollout, adv, mask, eps_low=0.8, eps_high=3.0)[0].backward()
    close(logp.grad, t([-0.25, 0.25, -1.5, 0.0]))


def test_dis_loss_every_token_masked_gives_zero_loss_and_grad() -> None:
    # r = 0.5, 8, 0.6: all outside (0.7, 6) -> loss 0, zero grads, masked_frac 1.
    rollout = t([0.0, 0.0, 0.0])
    logp = leaf(t([-LN2, 3 * LN2, math.log(0.6)]))
    loss, stats = dis_loss(logp, rollout, t([1.0, -1.0, 2.0]), m([1, 1, 1]))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros_like(logp))
    assert stats["dis/masked_frac"].item() == 1.0


def test_dis_loss_row_without_action_tokens_and_nan_padding() -> None:
    # Appending a row with no action token (full of NaN) changes nothing.
    logp, rollout, adv, mask = dis_case()
    ref_loss, ref_stats = dis_loss(logp, rollout, adv, mask)
    logp2 = leaf(torch.cat([logp.detach(), t([NAN, NAN, NAN, NAN])]))
    pad = t([NAN, NAN, NAN, NAN])
    loss, stats = dis_loss(
        logp2, torch.cat([rollout, pad]), torch.cat([adv, pad]), torch.cat([mask, m([0, 0, 0, 0])])
    )
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item())
    close(logp2.grad, torch.cat([t([-0.25, 0.0, -1.5, 0.0]), torch.zeros(1, 4)]))
    for name in ref_stats:
        assert stats[name].item() == pytest.approx(ref_stats[name].item()), name


def test_dis_loss_single_position() -> None:
    # T = 1, three rows: r = 1, 1, 2; A = 1, 2, 3; N = 3 -> grad = -(1, 2, 6)/3
    logp = leaf(torch.tensor([[0.0], [-1.0], [LN2 - 2.0]]))
    rollout = torch.tensor([[0.0], [-1.0], [-2.0]])
    adv = torch.tensor([[1.0], [2.0], [3.0]])
    dis_loss(logp, rollout, adv, torch.ones(3, 1, dtype=torch.bool))[0].backward()
    close(logp.grad, torch.tensor([[-1 / 3], [-2 / 3], [-2.0]]))


def test_dis_loss_bf16_inputs_get_float32_math_and_bf16_grads() -> None:
    logp32, rollout, adv, mask = dis_case()
    logp = leaf(logp32.detach().to(torch.bfloat16))
    loss, stats = dis_loss(logp, rollout.to(torch.bfloat16), adv.to(torch.bfloat16), mask)
    loss.backward()
    assert loss.dtype == torch.float32 and stats["dis/ratio_mean"].dtype == torch.float32
    assert logp.grad is not None and logp.grad.dtype == torch.bfloat16
    # Same keep pattern as in float32; bf16 rounding of logp shifts r by < 1%.
    torch.testing.assert_close(logp.grad.float(), t([-0.25, 0.0, -1.5, 0.0]), rtol=2e-2, atol=0)


# ---------------------------------------------------------------- PPO


def ppo_case() -> tuple[torch.Tensor, ...]:
    # old_logp = 0, r = 1.1, 1.5, 0.5, 0.5, 1.5; A = 1, 1, -1, 1, -1.
    logp = leaf(torch.log(t([1.1, 1.5, 0.5, 0.5, 1.5])))
    return logp, torch.zeros(1, 5), t([1.0, 1.0, -1.0, 1.0, -1.0]), m([1, 1, 1, 1, 1])


def test_ppo_clip_loss_hand_worked() -> None:
    # Band [0.8, 1.28]; obj = min(r·A, clip(r)·A):
    #   1.1 (free) | 1.28 (clip high, grad 0) | -0.8 (clip low, grad 0) | 0.5 (free) | -1.5 (free)
    # loss = -(1.1 + 1.28 - 0.8 + 0.5 - 1.5)/5 = -0.116
    # ∂loss/∂logp = -(r·A on free tokens)/5 = -0.22, 0, 0, -0.1, 0.3
    logp, old, adv, mask = ppo_case()
    loss, stats = ppo_clip_loss(logp, old, adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx(-0.116, abs=1e-6)
    close(logp.grad, t([-0.22, 0.0, 0.0, -0.1, 0.3]))
    assert stats["ppo/clip_low_frac"].item() == pytest.approx(0.2)
    assert stats["ppo/clip_high_frac"].item() == pytest.approx(0.2)
    assert stats["ppo/clip_frac"].item() == pytest.approx(0.4)
    assert stats["ppo/dual_clip_frac"].item() == 0.0
    assert stats["ppo/ratio_mean"].item() == pytest.approx(1.02)  # (1.1+1.5+.5+.5+1.5)/5
    assert stats["ppo/ratio_max"].item() == pytest.approx(1.5)
    assert stats["ppo/token_weight_mean"].item() == 1.0


def test_ppo_clip_loss_dual_clip_hand_worked() -> None:
    # c = 1.4: token 4 (A = -1, r = 1.5 > c) becomes max(-1.5, -1.4) = -1.4, grad 0.
    # loss = -(1.1 + 1.28 - 0.8 + 0.5 - 1.4)/5 = -0.136; grad = -0.22, 0, 0, -0.1, 0
    logp, old, adv, mask = ppo_case()
    loss, stats = ppo_clip_loss(logp, old, adv, mask, dual_clip=1.4)
    loss.backward()
    assert loss.item() == pytest.approx(-0.136, abs=1e-6)
    close(logp.grad, t([-0.22, 0.0, 0.0, -0.1, 0.0]))
    assert stats["ppo/dual_clip_frac"].item() == pytest.approx(0.2)


def test_ppo_clip_loss_token_weights_hand_worked() -> None:
    # w = 1, 1, 1, 0, 0.5: obj·w = 1.1, 1.28, -0.8, 0, -0.75 -> loss = -0.83/5 = -0.166
    # The zero-weight token still counts in N = 5. grad = -0.22, 0, 0, 0, 0.15
    logp, old, adv, mask = ppo_case()
    w = t([1.0, 1.0, 1.0, 0.0, 0.5])
    loss, stats = ppo_clip_loss(logp, old, adv, mask, token_weights_BT=w)
    loss.backward()
    assert loss.item() == pytest.approx(-0.166, abs=1e-6)
    close(logp.grad, t([-0.22, 0.0, 0.0, 0.0, 0.15]))
    assert stats["ppo/token_weight_mean"].item() == pytest.approx(0.7)
    assert stats["ppo/token_weight_zero_frac"].item() == pytest.approx(0.2)


def test_tis_weights_hand_worked() -> None:
    # exp(old - rollout) = 1, 3, 0.5 -> capped at 2: 1, 2, 0.5; detached.
    old = t([0.0, math.log(3.0), -LN2]).requires_grad_()
    w = tis_weights(old, torch.zeros(1, 3))
    close(w, t([1.0, 2.0, 0.5]))
    assert not w.requires_grad


def test_icepop_mask_hand_worked_edges_inclusive() -> None:
    # ratio 0.4, 0.5, 1, 2, 2.5 with band [0.5, 2] -> 0, 1, 1, 1, 0
    old = torch.log(t([0.4, 0.5, 1.0, 2.0, 2.5]))
    assert torch.equal(icepop_mask(old, torch.zeros(1, 5)), t([0.0, 1.0, 1.0, 1.0, 0.0]))


# ---------------------------------------------------------------- GSPO / CISPO


def test_gspo_loss_hand_worked() -> None:
    # Row 0: log r = 0.2, 0.4 (+ padding) -> s0 = e^0.3 = 1.34986 > 1 + 4e-4, A0 = 1:
    #   clipped, obj = 1.0004 per token, no gradient.
    # Row 1: log r = 0, 0, 0 -> s1 = 1, A = -1, -2, -3 -> A1 = mean = -2: obj = -2 per token.
    # loss = -mean over rows of row token means = -(1.0004 + (-2)) / 2 = 0.4998
    # ∂loss/∂logp (row 1) = -s1·A1 / (|y1| · G) = 2 / (3 · 2) = 1/3 each.
    logp = leaf(t([-1.0, -1.0, 0.0], [-0.5, -0.7, -0.9]))
    old = t([-1.2, -1.4, NAN], [-0.5, -0.7, -0.9])
    adv = t([1.0, 1.0, NAN], [-1.0, -2.0, -3.0])
    loss, stats = gspo_loss(logp, old, adv, m([1, 1, 0], [1, 1, 1]))
    loss.backward()
    assert loss.item() == pytest.approx(0.4998, abs=1e-6)
    close(logp.grad, t([0.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]))
    assert stats["gspo/clip_high_frac"].item() == pytest.approx(0.5)
    assert stats["gspo/clip_low_frac"].item() == 0.0
    assert stats["gspo/seq_ratio_mean"].item() == pytest.approx((math.exp(0.3) + 1) / 2)


def test_cispo_loss_hand_worked() -> None:
    # old = 0, r = 0.5, 1, 2; A = 1, -1, 2; weight = clip(r, 0, 1.28) = 0.5, 1, 1.28.
    # loss = -(0.5·1·ln .5 + 1·(-1)·0 + 1.28·2·ln 2)/3 = -1.427884/3 = -0.475961
    # ∂loss/∂logp = -w·A/3 = -0.166667, 0.333333, -0.853333 (none zero)
    logp = leaf(t([-LN2, 0.0, LN2]))
    loss, stats = cispo_loss(logp, torch.zeros(1, 3), t([1.0, -1.0, 2.0]), m([1, 1, 1]))
    loss.backward()
    assert loss.item() == pytest.approx(-0.475961, abs=1e-6)
    close(logp.grad, t([-1 / 6, 1 / 3, -2.56 / 3]))
    assert stats["cispo/clip_high_frac"].item() == pytest.approx(1 / 3)
    assert stats["cispo/clip_low_frac"].item() == 0.0


# ---------------------------------------------------------------- value loss


def test_value_loss_hand_worked() -> None:
    # V = 1, 2, 3; R = 1, 0, 5: (V - R)^2 = 0, 4, 4 -> loss 8/3; grad 2(V - R)/3 = 0, 4/3, -4/3
    # Var(R) = 14/3, Var(R - V) = Var(0, -2, 2) = 8/3 -> EV = 1 - 8/14 = 0.428571
    values = leaf(t([1.0, 2.0, 3.0, NAN]))
    returns = t([1.0, 0.0, 5.0, NAN])
    loss, stats = value_loss(values, returns, m([1, 1, 1, 0]))
    loss.backward()
    assert loss.item() == pytest.approx(8 / 3)
    close(values.grad, t([0.0, 4 / 3, -4 / 3, 0.0]))
    assert stats["critic/loss"].item() == pytest.approx(8 / 3)
    assert stats["critic/explained_variance"].item() == pytest.approx(1 - 8 / 14)
    assert stats["critic/value_mean"].item() == pytest.approx(2.0)
    assert stats["critic/return_mean"].item() == pytest.approx(2.0)
    assert stats["critic/clip_frac"].item() == 0.0


def test_value_loss_clipped_hand_worked() -> None:
    # V_old = 1, 1, 1; clip 0.5 -> V_clip = 1, 1.5, 1.5; (V_clip - R)^2 = 0, 2.25, 12.25
    # max with (V - R)^2 = 0, 4, 4 -> 0, 4, 12.25: loss = 16.25/3 = 5.416667
    # token 2 uses the clipped branch (constant in V): grad = 0, 4/3, 0; clip_frac = 1/3
    values = leaf(t([1.0, 2.0, 3.0]))
    loss, stats = value_loss(
        values, t([1.0, 0.0, 5.0]), m([1, 1, 1]), old_values_BT=t([1.0, 1.0, 1.0]), clip_eps=0.5
    )
    loss.backward()
    assert loss.item() == pytest.approx(16.25 / 3)
    close(values.grad, t([0.0, 4 / 3, 0.0]))
    assert stats["critic/clip_frac"].item() == pytest.approx(1 / 3)


# ---------------------------------------------------------------- bad input


POLICY_LOSSES = [dis_loss, ppo_clip_loss, cispo_loss, gspo_loss]


@pytest.mark.parametrize("loss_fn", POLICY_LOSSES)
def test_policy_losses_reject_bad_input(loss_fn: Callable[..., tuple]) -> None:
    x, mask = t([-1.0, -2.0, -3.0]), m([1, 1, 0])
    with pytest.raises(ValueError, match="advantages_BT has shape"):
        loss_fn(x, x, t([1.0, 2.0]), mask)
    with pytest.raises(ValueError, match=r"must be \[B, T\]"):
        loss_fn(x[0], x[0], x[0], mask[0])
    with pytest.raises(ValueError, match="no action token"):
        loss_fn(x, x, x, m([0, 0, 0]))
    with pytest.raises(ValueError, match="logp_BT contains 1 NaN"):
        loss_fn(t([NAN, -2.0, -3.0]), x, x, mask)
    with pytest.raises(ValueError, match="advantages_BT contains 1 NaN or inf"):
        loss_fn(x, x, t([1.0, math.inf, 0.0]), mask)
    loss_fn(x, x, t([1.0, 1.0, math.inf]), mask)  # inf on padding is fine
    with pytest.raises(ValueError, match="floating-point"):
        loss_fn(x, x, torch.ones(1, 3, dtype=torch.long), mask)
    for eps_low in (0.0, -0.1, 1.5, NAN):
        with pytest.raises(ValueError, match="eps_low must be in"):
            loss_fn(x, x, x, mask, eps_low=eps_low)
    for eps_high in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="eps_high must be in"):
            loss_fn(x, x, x, mask, eps_high=eps_high)


def test_loss_specific_bad_input() -> None:
    x, mask = t([-1.0, -2.0, -3.0]), m([1, 1, 1])
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(x, x, x, mask, dual_clip=1.0)
    with pytest.raises(ValueError, match="token_weights_BT must be >= 0"):
        ppo_clip_loss(x, x, x, mask, token_weights_BT=t([1.0, -0.5, 1.0]))
    with pytest.raises(ValueError, match="token_weights_BT has shape"):
        ppo_clip_loss(x, x, x, mask, token_weights_BT=t([1.0]))
    with pytest.raises(ValueError, match="old_values_BT is required"):
        value_loss(x, x, mask, clip_eps=0.2)
    with pytest.raises(ValueError, match="clip_eps"):
        value_loss(x, x, mask, old_values_BT=x, clip_eps=-0.2)
    with pytest.raises(ValueError, match="returns_BT contains"):
        value_loss(x, t([0.0, NAN, 0.0]), mask)
    with pytest.raises(ValueError, match="cap"):
        tis_weights(x, x, cap=0.0)
    with pytest.raises(ValueError, match="low must be in"):
        icepop_mask(x, x, low=1.5)
    with pytest.raises(ValueError, match="rollout_logp_BT has shape"):
        icepop_mask(x, t([1.0]))


# ---------------------------------------------------------------- shared contract


def _call(
    name: str, logp: torch.Tensor, other: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
):
    if name == "value":
        return value_loss(logp, adv, mask, old_values_BT=other, clip_eps=0.1)
    if name == "ppo_tis":
        w = tis_weights(other, other - 0.1)
        return ppo_clip_loss(logp, other, adv, mask, dual_clip=3.0, token_weights_BT=w)
    fn = {"dis": dis_loss, "ppo": ppo_clip_loss, "cispo": cispo_loss, "gspo": gspo_loss}[name]
    return fn(logp, other, adv, mask)


@pytest.mark.parametrize("name", ["dis", "ppo", "ppo_tis", "cispo", "gspo", "value"])
def test_nan_padding_never_leaks_and_stats_are_detached_scalars(name: str) -> None:
    # Padding (mask False) holds NaN and inf in every input: loss, grads and stats stay finite.
    mask = m([1, 1, 0, 0], [1, 0, 0, 0])
    pad = torch.where(mask, 0.0, t([NAN, math.inf, -math.inf, NAN], [NAN, NAN, math.inf, NAN]))
    logp = leaf(t([-1.0, -0.5, 0.0, 0.0], [-2.0, 0.0, 0.0, 0.0]) + pad)
    other = t([-1.1, -0.4, 0.0, 0.0], [-2.2, 0.0, 0.0, 0.0]) + pad
    adv = t([1.0, -1.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]) + pad
    loss, stats = _call(name, logp, other, adv, mask)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert torch.isfinite(logp.grad).all() and bool((logp.grad[~mask] == 0).all())
    for key, value in stats.items():
        assert key.split("/")[0] in {"dis", "ppo", "cispo", "gspo", "critic"}, key
        assert value.ndim == 0 and not value.requires_grad, key
        assert torch.isfinite(value), key
