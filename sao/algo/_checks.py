"""Input validation shared by every estimator and loss.

Each check raises ``ValueError`` naming the argument and what was expected, so
bad input never turns into a silent NaN loss.
"""

from __future__ import annotations

import torch


def check_same_shape(**tensors: torch.Tensor) -> tuple[int, ...]:
    """All tensors share one shape; returns it. Names appear in the error."""
    items = list(tensors.items())
    name0, t0 = items[0]
    for name, t in items[1:]:
        if t.shape != t0.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {name0} has shape {tuple(t0.shape)}; "
                "they must match"
            )
    return tuple(t0.shape)


def check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    """``t`` has ``ndim`` dimensions (``layout`` is e.g. ``"[B, T]"``)."""
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")


def check_finite(name: str, t: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """No NaN or inf in ``t`` (only positions where ``where`` is True, if given)."""
    if not t.is_floating_point():
        return
    # Elementwise, not `t[where]`: boolean indexing copies and costs a nonzero pass.
    bad = ~torch.isfinite(t.detach())
    if where is not None:
        bad &= where
    if bool(bad.any()):
        raise ValueError(
            f"{name} contains {int(bad.sum())} NaN or inf value(s); inputs must be finite"
        )


def check_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    """A boolean (or 0/1) mask; returned as ``torch.bool``."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() or mask.dtype in (
        torch.int8,
        torch.int16,
        torch.int32,
        torch.long,
        torch.uint8,
    ):
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError(f"{name} must be boolean or 0/1, found other values")
        return mask != 0
    raise ValueError(f"{name} must be a boolean mask, got dtype {mask.dtype}")


def check_any(name: str, mask: torch.Tensor) -> None:
    """At least one True entry: a batch with no action token has nothing to learn from."""
    if not bool(mask.any()):
        raise ValueError(
            f"{name} has no True entry: the batch contains no action token, so the loss "
            "is undefined; drop such batches before calling the loss"
        )


def check_range(
    name: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """``low <= value <= high`` (open ends when asked), and finite."""
    ok = value == value and abs(value) != float("inf")
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "-inf" if low is None else f"{low}"
        hi = "inf" if high is None else f"{high}"
        left = "(" if low_open or low is None else "["
        right = ")" if high_open or high is None else "]"
        interval = f"{left}{lo}, {hi}{right}"
        raise ValueError(f"{name} must be in {interval}, got {value}")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """``value`` is one of ``choices`` (e.g. a reduction name)."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def check_batch(mask_name: str, mask: torch.Tensor, **tensors: torch.Tensor) -> torch.Tensor:
    """Validate one ``[B, T]`` batch; returns the mask as ``torch.bool``.

    The mask is 2-D and has at least one True entry; every other tensor is
    floating point, has the mask's shape, and is finite wherever the mask is
    True (padding may hold anything: losses never read it).
    """
    check_ndim(mask_name, mask, 2, "[B, T]")
    check_same_shape(**{mask_name: mask}, **tensors)
    mask_bool = check_mask(mask_name, mask)
    check_any(mask_name, mask_bool)
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        check_finite(name, t, mask_bool)
    return mask_bool
