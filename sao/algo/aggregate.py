"""Reducing a per-token loss ``[B, T]`` over the action tokens to a scalar:
the reductions (token mean, per-sequence mean, Dr.GRPO's constant length) and
the whole-batch divisor that makes micro-batches add up. Pure tensor
functions; :mod:`sao.algo.losses` reduces every loss with them."""

from __future__ import annotations

import torch

from sao.algo._checks import check_batch, check_choice, check_range
from sao.algo.stats import zero_off

__all__ = ["REDUCTIONS", "aggregate", "aggregate_denom"]

REDUCTIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def _numerator(x_BT: torch.Tensor, mask_BT: torch.Tensor, reduction: str) -> torch.Tensor:
    """Sum over the batch that is additive over rows, so micro-batches add up."""
    x = torch.where(mask_BT, x_BT, 0.0)
    if reduction == "seq_mean_token_mean":
        return (x.sum(-1) / mask_BT.sum(-1).clamp(min=1)).sum()
    return x.sum()


def _default_denom(mask_BT: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "token_mean":
        return mask_BT.sum()
    rows = mask_BT.any(-1).sum()
    return rows if reduction == "seq_mean_token_mean" else rows * mask_BT.shape[-1]


def _aggregate(
    x_BT: torch.Tensor, mask_BT: torch.Tensor, reduction: str, denom: float | None
) -> torch.Tensor:
    d = _default_denom(mask_BT, reduction) if denom is None else denom
    return _numerator(x_BT, mask_BT, reduction) / d


def _check_reduction(reduction: str, denom: float | None) -> None:
    check_choice("reduction", reduction, REDUCTIONS)
    if denom is not None:
        check_range("denom", denom, low=0.0, low_open=True)


def aggregate(
    per_token_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    reduction: str = "token_mean",
    *,
    denom: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` over the action tokens to a scalar.

    Every reduction is ``numerator / denom``. ``token_mean``: Σ over action
    tokens / number of action tokens. ``seq_mean_token_mean``: Σ over rows of
    the row's token mean / number of rows. ``seq_mean_token_sum_norm``: Σ over
    action tokens / (number of rows · T). Rows without an action token are
    ignored (they count in no denominator).

    ``token_mean`` is DAPO's token-level loss and the SAO default
    (ALGORITHMS.md §1); ``seq_mean_token_mean`` is the GRPO paper's per-sample
    mean; ``seq_mean_token_sum_norm`` is Dr.GRPO (Liu et al. 2025, "Understanding
    R1-Zero-Like Training"): each row's token *sum* divided by a constant
    length, then averaged over rows. Its default constant is the padded length
    ``T``; for the paper's fixed generation budget pass
    ``denom = n_rows * max_new_tokens``.

    ``denom`` (micro-batching): numerators add up over row splits, so a trainer
    that splits a batch into micro-batches passes the *whole batch's* divisor,
    ``aggregate_denom(full_mask_BT, reduction)``, to every micro-batch; the
    summed micro-batch gradients then equal the full-batch gradient exactly.

    Shapes: ``per_token_BT`` float ``[B, T]``; ``mask_BT`` bool ``[B, T]``.
    Raises ``ValueError`` for an unknown ``reduction``, ``denom <= 0``, an
    empty mask, or a NaN/inf on an action position.
    """
    _check_reduction(reduction, denom)
    mask = check_batch("mask_BT", mask_BT, per_token_BT=per_token_BT)
    return _aggregate(zero_off(per_token_BT, mask), mask, reduction, denom)


def aggregate_denom(mask_BT: torch.Tensor, reduction: str = "token_mean") -> float:
    """The default ``denom`` of :func:`aggregate` for this (whole) batch.

    Compute it once on the full batch's mask and pass it to every micro-batch.
    """
    check_choice("reduction", reduction, REDUCTIONS)
    mask = check_batch("mask_BT", mask_BT)
    return float(_default_denom(mask, reduction))
