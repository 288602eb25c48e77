"""Policy and value losses: pure tensor functions, one per variant.

Every loss takes ``[B, T]`` tensors and the action mask and returns
``(loss, stats)``: a 0-dim loss to call ``backward`` on, and detached 0-dim
statistics keyed ``"<loss>/<name>"``. The gradient flows into ``logp_BT`` (or
``values_BT``) only; old/rollout log-probabilities, advantages, returns and
weights are constants. bf16/fp16 inputs are computed in float32 (gradients
still reach them); padding is never read, so it may hold anything, even NaN.
Bad input (mismatched shapes, no action token, NaN/inf on an action token, an
out-of-range ``eps``, an unknown ``reduction``) raises ``ValueError``. The
reductions are :mod:`~sao.algo.aggregate`'s (re-exported here).
"""

from __future__ import annotations

import torch

from sao.algo._checks import check_batch, check_range, check_same_shape
from sao.algo.aggregate import REDUCTIONS, _aggregate, _check_reduction, aggregate, aggregate_denom
from sao.algo.stats import (
    _ess_n,
    _explained_variance_n,
    _fractions_n,
    _kl_k1_n,
    _kl_k3_n,
    as_compute_dtype,
    pack,
    zero_off,
)

__all__ = [
    "REDUCTIONS",
    "aggregate",
    "aggregate_denom",
    "cispo_loss",
    "dis_loss",
    "gspo_loss",
    "icepop_mask",
    "ppo_clip_loss",
    "tis_weights",
    "value_loss",
]

Stats = dict[str, torch.Tensor]

# ---------------------------------------------------------------- shared pieces


def _check_policy(
    action_mask_BT: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    eps: tuple[float, float],
    reduction: str,
    denom: float | None,
) -> torch.Tensor:
    """Validate a policy loss's arguments; returns the action mask as bool."""
    check_range("eps_low", eps[0], low=0.0, high=1.0, low_open=True)
    check_range("eps_high", eps[1], low=0.0, low_open=True)
    _check_reduction(reduction, denom)
    return check_batch("action_mask_BT", action_mask_BT, **tensors)


def _ratio_stats(prefix: str, log_ratio_N: torch.Tensor) -> Stats:
    """Mean/max/min of ``r = exp(log_ratio)`` and the k1/k3 KL(sampler || trainer).

    ``log_ratio_N = logp_trainer - logp_sampler`` over the action tokens (packed).
    """
    ratio_N = torch.exp(log_ratio_N)
    return {
        f"{prefix}/ratio_mean": ratio_N.mean(),
        f"{prefix}/ratio_max": ratio_N.max(),
        f"{prefix}/ratio_min": ratio_N.min(),
        f"{prefix}/kl_k1": _kl_k1_n(log_ratio_N),
        f"{prefix}/kl_k3": _kl_k3_n(log_ratio_N),
    }


def _log_ratio(num_logp_BT: torch.Tensor, den_logp_BT: torch.Tensor) -> torch.Tensor:
    """Detached ``num - den`` in the compute dtype (for weights computed outside a loss)."""
    return as_compute_dtype(num_logp_BT.detach()) - as_compute_dtype(den_logp_BT.detach())


def _frac(cond_N: torch.Tensor) -> torch.Tensor:
    return cond_N.float().mean()


# ---------------------------------------------------------------- policy losses


def dis_loss(
    logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    action_mask_BT: torch.Tensor,
    *,
    eps_low: float = 0.3,
    eps_high: float = 5.0,
    reduction: str = "token_mean",
    denom: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """DIS: the SAO actor loss (ALGORITHMS.md §1; Hou, Li, Tang et al. 2026).

    ``r = exp(logp - rollout_logp)`` against the rollout engine's per-token
    log-probabilities (no old-policy pass). A token is kept iff
    ``1 - eps_low < r < 1 + eps_high`` (strict, compared in the compute dtype),
    whatever the sign of its advantage; a dropped token gets exactly zero
    gradient (it is not clipped to the edge). Surrogate per token:
    ``keep · sg(r) · A · logp``, so ``∂loss/∂logp = -keep · r · A / denom``;
    ``loss = -aggregate(surrogate)``. Dropped tokens stay in the denominator,
    so heavy masking shrinks the step. No PPO min/clip, KL or entropy term.
    The loss *value* is a gradient carrier, not an objective estimate.

    Defaults are the paper's math band ``(0.7, 6.0)``; its coding/SWE band is
    ``eps_low=0.8, eps_high=3.0``. ``eps_low`` in ``(0, 1]``, ``eps_high > 0``.

    Shapes: all ``[B, T]``; ``action_mask_BT`` bool.
    Stats (``dis/``): ``masked_frac``, ``masked_low_frac``, ``masked_high_frac``,
    ``ratio_mean``/``max``/``min``, ``kl_k1``/``kl_k3`` (KL(rollout || trainer),
    see :func:`sao.algo.stats.kl_k1`), ``ess`` (normalised ESS of ``r``).
    """
    inputs = {
        "logp_BT": logp_BT,
        "rollout_logp_BT": rollout_logp_BT,
        "advantages_BT": advantages_BT,
    }
    mask = _check_policy(action_mask_BT, inputs, (eps_low, eps_high), reduction, denom)
    logp = zero_off(logp_BT, mask)
    log_ratio = logp.detach() - zero_off(rollout_logp_BT.detach(), mask)
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - eps_low, 1.0 + eps_high
    keep = mask & (ratio > low) & (ratio < high)
    # `where`, not a product: r may overflow to inf on a dropped token.
    coef = torch.where(keep, ratio * zero_off(advantages_BT.detach(), mask), 0.0)
    loss = -_aggregate(coef * logp, mask, reduction, denom)

    log_ratio_N, adv_N = pack(mask, log_ratio, advantages_BT)
    low_frac, high_frac = _fractions_n(torch.exp(log_ratio_N), low, high)
    stats = {
        "dis/masked_frac": low_frac + high_frac,
        "dis/masked_low_frac": low_frac,
        "dis/masked_high_frac": high_frac,
        **_masked_signal_n(log_ratio_N, adv_N, low, high),
        **_ratio_stats("dis", log_ratio_N),
        "dis/ess": _ess_n(log_ratio_N),
    }
    return loss, stats


def _masked_signal_n(
    log_ratio_N: torch.Tensor, adv_N: torch.Tensor, low: float, high: float
) -> Stats:
    """What the band throws away: ``dis/masked_adv_share``, the masked tokens' share of
    the batch's advantage mass (sum of ``|A|``; 0 when every advantage is 0), and
    ``dis/masked_neg_adv_frac``, the share of action tokens masked with a negative
    advantage (``masked_frac`` minus it: masked with one >= 0)."""
    ratio_N = torch.exp(log_ratio_N)
    dropped_N = ~((ratio_N > low) & (ratio_N < high))
    mass = adv_N.abs().sum()
    share = adv_N.abs()[dropped_N].sum() / mass if bool(mass > 0) else mass * 0.0
    neg = (dropped_N & (adv_N < 0)).to(adv_N.dtype).mean()
    return {"dis/masked_adv_share": share, "dis/masked_neg_adv_frac": neg}


def ppo_clip_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    action_mask_BT: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
    token_weights_BT: torch.Tensor | None = None,
    reduction: str = "token_mean",
    denom: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with clip-higher.

    ``r = exp(logp - old_logp)``; per token
    ``obj = min(r·A, clip(r, 1 - eps_low, 1 + eps_high)·A)``. Asymmetric bands
    are DAPO's clip-higher (Yu et al. 2025; defaults 0.2 / 0.28).
    ``dual_clip = c > 1`` (dual-clip PPO, Ye et al. 2020, "Mastering Complex
    Control in MOBA Games") bounds the objective of negative-advantage tokens:
    ``obj = max(obj, c·A)`` where ``A < 0``. ``token_weights_BT`` (e.g.
    :func:`tis_weights` or :func:`icepop_mask`) multiplies ``obj`` per token,
    as constants; a weight of 0 removes the token's gradient but keeps it in
    the denominator, like a DIS-masked token. ``loss = -aggregate(w·obj)``.

    Shapes: all ``[B, T]``. ``eps_low`` in ``(0, 1]``, ``eps_high > 0``.
    Stats (``ppo/``): ``clip_frac`` = ``clip_low_frac`` (``A < 0``,
    ``r < 1 - eps_low``) + ``clip_high_frac`` (``A > 0``, ``r > 1 + eps_high``),
    i.e. the tokens whose gradient the clip zeroes; ``dual_clip_frac``;
    ``ratio_mean``/``max``/``min``; ``kl_k1`` and ``kl_k3`` (PPO's
    "approx_kl") of KL(old || trainer); ``token_weight_mean`` and
    ``token_weight_zero_frac`` (1 and 0 without weights).
    """
    if dual_clip is not None:
        check_range("dual_clip", dual_clip, low=1.0, low_open=True)
    inputs = {"logp_BT": logp_BT, "old_logp_BT": old_logp_BT, "advantages_BT": advantages_BT}
    if token_weights_BT is not None:
        inputs["token_weights_BT"] = token_weights_BT
    mask = _check_policy(action_mask_BT, inputs, (eps_low, eps_high), reduction, denom)
    adv = zero_off(advantages_BT.detach(), mask)
    log_ratio = zero_off(logp_BT, mask) - zero_off(old_logp_BT.detach(), mask)
    obj = _ppo_objective(torch.exp(log_ratio), adv, eps_low, eps_high, dual_clip)
    weights = torch.ones_like(adv)
    if token_weights_BT is not None:
        weights = zero_off(token_weights_BT.detach(), mask)
        if bool((weights < 0).any()):
            raise ValueError("token_weights_BT must be >= 0 on action tokens")
        obj = obj * weights
    loss = -_aggregate(obj, mask, reduction, denom)
    return loss, _ppo_stats(mask, log_ratio, adv, weights, eps_low, eps_high, dual_clip)


def _ppo_objective(
    ratio_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
) -> torch.Tensor:
    """Per-token ``min(r·A, clip(r, 1 - eps_low, 1 + eps_high)·A)``, then
    ``max(obj, c·A)`` where ``A < 0`` with ``dual_clip = c``. Shapes ``[B, T]``."""
    obj = torch.minimum(ratio_BT * adv_BT, ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_BT)
    if dual_clip is not None:
        obj = torch.where(adv_BT < 0, torch.maximum(obj, dual_clip * adv_BT), obj)
    return obj


def _ppo_stats(
    mask_BT: torch.Tensor,
    log_ratio_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    weights_BT: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
) -> Stats:
    """:func:`ppo_clip_loss`'s ``ppo/`` stats over the action tokens."""
    log_ratio_N, adv_N, w_N = pack(mask_BT, log_ratio_BT, adv_BT, weights_BT)
    r_N = torch.exp(log_ratio_N)
    low = _frac((adv_N < 0) & (r_N < 1.0 - eps_low))
    high = _frac((adv_N > 0) & (r_N > 1.0 + eps_high))
    dual = (
        _frac((adv_N < 0) & (r_N > dual_clip)) if dual_clip is not None else torch.zeros_like(low)
    )
    return {
        "ppo/clip_frac": low + high,
        "ppo/clip_low_frac": low,
        "ppo/clip_high_frac": high,
        "ppo/dual_clip_frac": dual,
        **_ratio_stats("ppo", log_ratio_N),
        "ppo/token_weight_mean": w_N.mean(),
        "ppo/token_weight_zero_frac": _frac(w_N == 0),
    }


def tis_weights(
    old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, *, cap: float = 2.0
) -> torch.Tensor:
    """Truncated importance weights ``min(exp(old_logp - rollout_logp), cap)``.

    Corrects the train/inference mismatch: ``old_logp`` is the trainer's
    recomputation under the sampling weights, ``rollout_logp`` what the
    inference engine reported (Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training", truncated IS with C = 2).
    Pass the result as ``token_weights_BT`` of :func:`ppo_clip_loss`.
    Detached ``[B, T]`` in the compute dtype; padding entries are meaningless.
    """
    check_range("cap", cap, low=0.0, low_open=True)
    check_same_shape(old_logp_BT=old_logp_BT, rollout_logp_BT=rollout_logp_BT)
    return torch.exp(_log_ratio(old_logp_BT, rollout_logp_BT)).clamp(max=cap)


def icepop_mask(
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    *,
    low: float = 0.5,
    high: float = 2.0,
) -> torch.Tensor:
    """IcePop token mask: 1.0 where ``low <= exp(old_logp - rollout_logp) <= high``, else 0.0.

    Drops tokens whose trainer and inference-engine probabilities disagree
    too much (Ling Team 2025, "Every Step Evolves: Scaling RL for Trillion-Scale
    Thinking Model", IcePop, band [0.5, 2]). Pass the result as
    ``token_weights_BT`` of :func:`ppo_clip_loss`. Detached ``[B, T]``.
    """
    check_range("low", low, low=0.0, high=1.0)
    check_range("high", high, low=1.0)
    check_same_shape(old_logp_BT=old_logp_BT, rollout_logp_BT=rollout_logp_BT)
    ratio = torch.exp(_log_ratio(old_logp_BT, rollout_logp_BT))
    return ((ratio >= low) & (ratio <= high)).float()


def gspo_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    action_mask_BT: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    denom: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """GSPO: PPO clipping on a sequence-level ratio (Zheng et al. 2025, arXiv 2507.18071).

    Per row i with action tokens y_i: ``s_i = exp(mean_t(logp - old_logp))``
    (the geometric mean of the token ratios) and ``A_i`` = mean of the row's
    advantages over its action tokens (equal to the given value when, as in
    GRPO/GSPO, every token of a row carries the same advantage). Token form
    (GSPO-token, §4.3): ``s_it = sg(s_i) · exp(logp_t - sg(logp_t))``, whose
    value is ``s_i`` and whose gradient is ``s_i ∇logp_t``; per token
    ``min(s_it A_i, clip(s_it, 1 - eps_low, 1 + eps_high) A_i)``, averaged over
    the row's tokens, then over rows (``seq_mean_token_mean``); a clipped row
    gets no gradient. The paper's bands (§5.1) are 3e-4 / 4e-4.

    ``denom``: the whole batch's number of rows with an action token, for
    micro-batching (see :func:`aggregate`). Shapes: all ``[B, T]``.
    Stats (``gspo/``): ``clip_frac``/``clip_low_frac``/``clip_high_frac`` (of
    rows), ``seq_ratio_mean``/``max``/``min``, token ``kl_k1``/``kl_k3``.
    """
    inputs = {"logp_BT": logp_BT, "old_logp_BT": old_logp_BT, "advantages_BT": advantages_BT}
    mask = _check_policy(action_mask_BT, inputs, (eps_low, eps_high), "seq_mean_token_mean", denom)
    logp = zero_off(logp_BT, mask)
    log_ratio = logp.detach() - zero_off(old_logp_BT.detach(), mask)
    n_B = mask.sum(-1).clamp(min=1)
    seq_ratio_B = torch.exp(log_ratio.sum(-1) / n_B)
    seq_adv_B1 = (zero_off(advantages_BT.detach(), mask).sum(-1) / n_B)[:, None]
    s_BT = seq_ratio_B[:, None] * torch.exp(logp - logp.detach())
    clipped_BT = s_BT.clamp(1.0 - eps_low, 1.0 + eps_high)
    obj = torch.minimum(s_BT * seq_adv_B1, clipped_BT * seq_adv_B1)
    loss = -_aggregate(obj, mask, "seq_mean_token_mean", denom)

    rows_B = mask.any(-1)
    seq_ratio_R, seq_adv_R = seq_ratio_B[rows_B], seq_adv_B1[rows_B, 0]  # B entries: cheap
    low = _frac((seq_adv_R < 0) & (seq_ratio_R < 1.0 - eps_low))
    high = _frac((seq_adv_R > 0) & (seq_ratio_R > 1.0 + eps_high))
    (log_ratio_N,) = pack(mask, log_ratio)
    stats = {
        "gspo/clip_frac": low + high,
        "gspo/clip_low_frac": low,
        "gspo/clip_high_frac": high,
        "gspo/seq_ratio_mean": seq_ratio_R.mean(),
        "gspo/seq_ratio_max": seq_ratio_R.max(),
        "gspo/seq_ratio_min": seq_ratio_R.min(),
        "gspo/kl_k1": _kl_k1_n(log_ratio_N),
        "gspo/kl_k3": _kl_k3_n(log_ratio_N),
    }
    return loss, stats


def cispo_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    action_mask_BT: torch.Tensor,
    *,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
    reduction: str = "token_mean",
    denom: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """CISPO: clipped, detached IS weight on REINFORCE (MiniMax-M1, 2025, eq. 4).

    Per token ``sg(clip(r, 1 - eps_low, 1 + eps_high)) · A · logp`` with
    ``r = exp(logp - old_logp)``; ``loss = -aggregate(...)``. Unlike PPO, the
    clip bounds the *weight*, not the objective, so every action token with
    ``A != 0`` keeps a gradient. Defaults: ``eps_low = 1.0`` gives lower bound
    0, i.e. no lower truncation (the paper sets ``eps_low^IS`` "to a large
    value"); the paper does not publish ``eps_high^IS``, so 0.28 (DAPO's
    clip-higher) is our choice. ``eps_low`` in ``(0, 1]``, ``eps_high > 0``.

    Shapes: all ``[B, T]``. Stats (``cispo/``): ``clip_low_frac`` /
    ``clip_high_frac`` (tokens whose weight was truncated), ``clip_frac``,
    ``ratio_mean``/``max``/``min``, ``kl_k1``/``kl_k3`` KL(old || trainer).
    """
    inputs = {"logp_BT": logp_BT, "old_logp_BT": old_logp_BT, "advantages_BT": advantages_BT}
    mask = _check_policy(action_mask_BT, inputs, (eps_low, eps_high), reduction, denom)
    logp = zero_off(logp_BT, mask)
    log_ratio = logp.detach() - zero_off(old_logp_BT.detach(), mask)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    coef = weight * zero_off(advantages_BT.detach(), mask)
    loss = -_aggregate(coef * logp, mask, reduction, denom)

    (log_ratio_N,) = pack(mask, log_ratio)
    r_N = torch.exp(log_ratio_N)
    low, high = _frac(r_N < 1.0 - eps_low), _frac(r_N > 1.0 + eps_high)
    stats = {
        "cispo/clip_frac": low + high,
        "cispo/clip_low_frac": low,
        "cispo/clip_high_frac": high,
        **_ratio_stats("cispo", log_ratio_N),
    }
    return loss, stats


# ---------------------------------------------------------------- value loss


def value_loss(
    values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    old_values_BT: torch.Tensor | None = None,
    clip_eps: float | None = None,
    reduction: str = "token_mean",
    denom: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Critic loss: masked squared error ``(V - R)^2`` (ALGORITHMS.md §4).

    No 0.5 factor: the paper states plain squared error; the factor would only
    halve the gradient, i.e. act as a critic learning rate ×0.5. Returns are
    fixed targets (no gradient). With ``clip_eps`` (PPO-style value clipping,
    off by default; Schulman et al. 2017 / OpenAI baselines):
    ``V_clip = V_old + clip(V - V_old, -clip_eps, clip_eps)`` and the per-token
    loss is ``max((V - R)^2, (V_clip - R)^2)``; this needs ``old_values_BT``
    (which is only read when ``clip_eps`` is set).

    Shapes: all ``[B, T]``; ``mask_BT`` marks action tokens.
    Stats (``critic/``): ``loss``, ``explained_variance`` (NaN when the
    returns are constant, see :func:`sao.algo.stats.explained_variance`),
    ``value_mean``, ``return_mean``, ``clip_frac`` (tokens where the clipped
    branch is strictly larger; 0 without clipping).
    """
    _check_reduction(reduction, denom)
    extra: dict[str, torch.Tensor] = {}
    if clip_eps is not None:
        check_range("clip_eps", clip_eps, low=0.0, low_open=True)
        if old_values_BT is None:
            raise ValueError("clip_eps is set, so old_values_BT is required (got None)")
        extra["old_values_BT"] = old_values_BT
    mask = check_batch("mask_BT", mask_BT, values_BT=values_BT, returns_BT=returns_BT, **extra)
    values = zero_off(values_BT, mask)
    returns = zero_off(returns_BT.detach(), mask)
    per_token = (values - returns) ** 2
    clipped = torch.zeros_like(mask)
    if clip_eps is not None and old_values_BT is not None:
        old = zero_off(old_values_BT.detach(), mask)
        v_clip = old + (values - old).clamp(-clip_eps, clip_eps)
        per_token_clip = (v_clip - returns) ** 2
        clipped = per_token_clip.detach() > per_token.detach()
        per_token = torch.maximum(per_token, per_token_clip)
    loss = _aggregate(per_token, mask, reduction, denom)
    values_N, returns_N, clipped_N = pack(mask, values, returns, clipped)
    stats = {
        "critic/loss": loss.detach(),
        "critic/explained_variance": _explained_variance_n(values_N, returns_N),
        "critic/value_mean": values_N.mean(),
        "critic/return_mean": returns_N.mean(),
        "critic/clip_frac": clipped_N.mean(),
    }
    return loss, stats
