"""Masked statistics over ``[B, T]`` batches: means, variances, explained
variance, KL estimators, effective sample size and band fractions.

Every function takes a boolean (or 0/1) ``mask_BT`` of the same shape as its
data and only reads positions where the mask is True; padding may hold
anything, including NaN, without leaking into the result or its gradient.
Inputs in bf16/fp16 are computed in float32 (float64 stays float64).

The ``_``-prefixed kernels skip validation; :mod:`sao.algo.losses` calls them
on inputs it has already checked (the ``_n`` ones take a packed ``[N]``
vector of the masked entries, see :func:`pack`).
"""

from __future__ import annotations

import math

import torch

from sao.algo._checks import check_any, check_mask, check_same_shape

__all__ = [
    "binary_auc",
    "effective_sample_size",
    "explained_variance",
    "explained_variance_n",
    "kl_k1",
    "kl_k3",
    "masked_fractions",
    "masked_mean",
    "masked_sum",
    "masked_var",
]


# ---------------------------------------------------------------- kernels


def as_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or float64 if it already is (bf16/fp16 are upcast).

    The cast is differentiable: gradients flow back to a bf16 leaf.
    """
    return x if x.dtype == torch.float64 else x.float()


def zero_off(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """``x`` in the compute dtype with every position outside ``mask`` set to 0.

    Done before any arithmetic so a NaN in padding can reach neither the value
    nor the gradient (``where`` passes a zero gradient to unselected entries,
    but ``0 * nan`` further up the graph would still be NaN).
    """
    return torch.where(mask_BT, as_compute_dtype(x_BT), 0.0)


def _sum(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return zero_off(x_BT, mask_BT).sum()


def _mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return _sum(x_BT, mask_BT) / mask_BT.sum()


def _var(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    x = zero_off(x_BT, mask_BT)
    centred = torch.where(mask_BT, x - _mean(x, mask_BT), 0.0)
    return (centred * centred).sum() / mask_BT.sum()


def pack(mask_BT: torch.Tensor, *xs_BT: torch.Tensor) -> list[torch.Tensor]:
    """Detached masked entries of each ``x`` as flat ``[N]`` vectors in the compute dtype.

    Diagnostics (everything below) work on these packed samples: one shared
    index (a single ``nonzero``) and one gather per tensor, then plain
    reductions, instead of a masked pass per statistic.
    """
    idx_N = mask_BT.flatten().nonzero().squeeze(1)
    return [as_compute_dtype(x.detach()).flatten().index_select(0, idx_N) for x in xs_BT]


def _explained_variance_n(values_N: torch.Tensor, returns_N: torch.Tensor) -> torch.Tensor:
    var_r = returns_N.var(correction=0)
    ev = 1.0 - (returns_N - values_N).var(correction=0) / var_r
    # Returns rebuilt as advantage + value carry rounding noise: a spread below
    # float resolution of their scale counts as constant (EV undefined).
    scale = returns_N.abs().max().clamp(min=1.0)
    tiny = (torch.finfo(returns_N.dtype).eps * 64 * scale) ** 2
    return torch.where(var_r > tiny, ev, math.nan)  # on device: no host sync


def _kl_k1_n(log_r_N: torch.Tensor) -> torch.Tensor:
    """k1 from ``log r = log p - log q``: mean of ``-log r = log q - log p``."""
    return -log_r_N.mean()


def _kl_k3_n(log_r_N: torch.Tensor) -> torch.Tensor:
    """k3: mean of ``(r - 1) - log r``; expm1 keeps accuracy when r is close to 1."""
    return (torch.expm1(log_r_N) - log_r_N).mean()


def _ess_n(log_w_N: torch.Tensor) -> torch.Tensor:
    # ESS is invariant to scaling w, so shift log w by its max: the weights are
    # then in (0, 1] with the largest exactly 1, so nothing overflows and the
    # sums are >= 1 (underflowing tiny weights are negligible next to 1).
    w = torch.exp(log_w_N - log_w_N.max())
    return (w.sum() ** 2 / (w.numel() * (w * w).sum())).clamp(max=1.0)  # clamp: rounding


def _fractions_n(
    ratio_N: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return (ratio_N <= low).float().mean(), (ratio_N >= high).float().mean()


# ---------------------------------------------------------------- public API


def _checked(
    mask_BT: torch.Tensor, *, need_any: bool = True, **tensors: torch.Tensor
) -> torch.Tensor:
    check_same_shape(**tensors, mask_BT=mask_BT)
    m = check_mask("mask_BT", mask_BT)
    if need_any:
        check_any("mask_BT", m)
    return m


def masked_sum(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is True (0 for an empty mask).

    Shapes: ``x_BT`` and ``mask_BT`` any shape, equal. Differentiable in ``x``.
    """
    return _sum(x_BT, _checked(mask_BT, need_any=False, x_BT=x_BT))


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over masked positions. An empty mask is a ``ValueError``."""
    return _mean(x_BT, _checked(mask_BT, x_BT=x_BT))


def masked_var(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Population variance ``mean((x - mean(x))^2)`` over masked positions.

    Biased (divides by n, not n - 1): it is used for ratios such as the
    explained variance, where the factor cancels, and for whitening, where a
    single element then gives variance 0 instead of a NaN.
    """
    return _var(x_BT, _checked(mask_BT, x_BT=x_BT))


def explained_variance(
    values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """``1 - Var(R - V) / Var(R)`` over masked positions (ALGORITHMS.md §4).

    1 is a perfect critic, 0 is no better than predicting the mean return, and
    it is negative when the critic is worse than that. When the masked returns
    are all equal (``Var(R) = 0``, e.g. every episode got reward 0, or a single
    action token) the quantity is undefined and the result is NaN, as in
    cleanrl and stable-baselines3, so a logger shows a gap rather than a
    made-up number. Detached: a diagnostic, not a loss.

    Shapes: ``values_BT``, ``returns_BT``, ``mask_BT`` all ``[B, T]``.
    """
    m = _checked(mask_BT, values_BT=values_BT, returns_BT=returns_BT)
    return _explained_variance_n(*pack(m, values_BT, returns_BT))


def kl_k1(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Schulman's k1 estimate of ``KL(q || p)``: mean of ``log q - log p``.

    Direction: the tokens were **sampled from q**, whose log-probabilities are
    ``ref_logp_BT`` (the rollout engine / old policy); ``logp_BT`` is p (the
    trainer). Unbiased for ``KL(q || p)`` but high-variance, and a single
    sample can be negative. (J. Schulman, "Approximating KL Divergence", 2020.)

    Shapes: all ``[B, T]``. Detached.
    """
    m = _checked(mask_BT, logp_BT=logp_BT, ref_logp_BT=ref_logp_BT)
    logp_N, ref_logp_N = pack(m, logp_BT, ref_logp_BT)
    return _kl_k1_n(logp_N - ref_logp_N)


def kl_k3(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of ``KL(q || p)``: mean of ``(r - 1) - log r``, ``r = p / q``.

    Same direction as :func:`kl_k1` (samples from q = ``ref_logp_BT``, p =
    ``logp_BT``); unbiased, every term >= 0, lower variance than k1 when p and
    q are close. This is PPO's usual "approx_kl". Detached.
    """
    m = _checked(mask_BT, logp_BT=logp_BT, ref_logp_BT=ref_logp_BT)
    logp_N, ref_logp_N = pack(m, logp_BT, ref_logp_BT)
    return _kl_k3_n(logp_N - ref_logp_N)


def effective_sample_size(log_w_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Normalised effective sample size ``(Σ w)^2 / (n Σ w^2)``, in ``(0, 1]``.

    ``w = exp(log_w)`` over the n masked positions (Kish's ESS divided by n):
    1 when all weights are equal, ``1/n`` when one weight dominates. Computed
    from ``log_w - max(log_w)`` (ESS does not change when every weight is
    scaled), so huge or tiny weights neither overflow nor underflow. Detached.
    """
    return _ess_n(pack(_checked(mask_BT, log_w_BT=log_w_BT), log_w_BT)[0])


def masked_fractions(
    ratio_BT: torch.Tensor, mask_BT: torch.Tensor, *, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fractions of masked positions with ``ratio <= low`` and with ``ratio >= high``.

    The comparisons are inclusive, matching the strict DIS keep band
    ``low < r < high``: a token at an edge counts as masked. Detached.
    """
    return _fractions_n(pack(_checked(mask_BT, ratio_BT=ratio_BT), ratio_BT)[0], low, high)


def explained_variance_n(values_N: torch.Tensor, returns_N: torch.Tensor) -> torch.Tensor:
    """:func:`explained_variance` of two flat ``[N]`` vectors (every entry counts):
    ``1 - Var(R - V) / Var(R)``; NaN when the returns are all equal. Detached."""
    check_same_shape(values_N=values_N, returns_N=returns_N)
    if values_N.numel() == 0:
        return torch.tensor(math.nan)
    return _explained_variance_n(as_compute_dtype(values_N.detach()), as_compute_dtype(returns_N))


def binary_auc(scores_N: torch.Tensor, positive_N: torch.Tensor) -> torch.Tensor:
    """Area under the ROC curve of ``scores`` for telling ``positive`` entries from
    the others: the probability that a random positive scores above a random
    negative, ties counted one half (the Mann-Whitney U statistic over
    ``n_pos * n_neg``). 0.5 is chance, 1 a perfect ranking. NaN when either class
    is empty. Shapes: both ``[N]``. Detached.

    Example: scores (0.1, 0.4, 0.35, 0.8), positives (F, F, T, T): of the 4
    positive/negative pairs, (0.35 vs 0.1), (0.8 vs 0.1), (0.8 vs 0.4) are
    ordered right and (0.35 vs 0.4) wrong: AUC 3/4.
    """
    check_same_shape(scores_N=scores_N, positive_N=positive_N)
    pos = positive_N.bool().flatten()
    x = as_compute_dtype(scores_N.detach()).flatten()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return torch.tensor(math.nan, dtype=x.dtype)
    # pairwise comparison: N is a held-out set (hundreds), so N^2 is small
    diff = x[pos].unsqueeze(1) - x[~pos].unsqueeze(0)
    wins = (diff > 0).to(x.dtype).sum() + 0.5 * (diff == 0).to(x.dtype).sum()
    return wins / (n_pos * n_neg)
