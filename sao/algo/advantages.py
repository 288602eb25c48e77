"""Critic-based advantage estimators: skip-observation token-level GAE, the
step-level (per-turn) variants, and VAPO's length-adaptive lambda.

All functions are pure tensor functions over right-padded ``[B, T]`` batches
(ALGORITHMS.md, "Notation"). Only action positions are ever read: values,
rewards and advantages at prompt, observation and padding positions are
ignored on input and are 0 on output, so NaN there cannot leak.

Implementation: the action tokens of each row are packed to the left (one
``scatter``), ordinary GAE runs on the packed ``[B, L]`` tensors (``L`` = most
action tokens in a row) with a reverse scan, and the result is gathered back.
Deleting the non-action positions *is* the skip-observation rule
(ALGORITHMS.md section 3), so the code is the specification.
"""

from __future__ import annotations

from typing import Literal

import torch

from sao.algo._checks import (
    check_choice,
    check_finite,
    check_mask,
    check_ndim,
    check_range,
    check_same_shape,
)

Truncation = Literal["bootstrap", "zero"]
TurnValue = Literal["average", "last_token"]
_TRUNCATIONS: tuple[str, ...] = ("bootstrap", "zero")
_TURN_VALUES: tuple[str, ...] = ("average", "last_token")


# --------------------------------------------------------------------------- lambda


def adaptive_lambda(lengths_B: torch.Tensor, *, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive lambda from counts: ``lam = 1 - 1 / (alpha * l)``.

    VAPO (Yue et al. 2025, arXiv 2504.05118), "Length-Adaptive GAE"; the SAO
    paper uses it for the actor with ``alpha = 1.5`` (ALGORITHMS.md section 3)
    and, with ``l`` = number of turns, for the step-level variants.

    [choice] The result is clamped to ``[0, 1]``: a row with ``l = 0`` or
    ``alpha * l < 1`` gets ``lam = 0`` (one-step TD), never a negative lambda.

    Shapes: ``lengths_B`` [B] (integer or float counts, >= 0) -> ``lam_B`` [B]
    float32 (float64 if ``lengths_B`` is float64).
    """
    check_range("alpha", alpha, low=0.0, low_open=True)
    check_ndim("lengths_B", lengths_B, 1, "[B]")
    check_finite("lengths_B", lengths_B)
    if bool((lengths_B < 0).any()):
        raise ValueError("lengths_B must be >= 0 (counts of tokens or turns)")
    dtype = torch.float64 if lengths_B.dtype == torch.float64 else torch.float32
    scaled_B = alpha * lengths_B.to(dtype)
    lam_B = 1.0 - 1.0 / scaled_B.clamp(min=1.0)  # alpha*l < 1 (incl. l = 0) -> 0
    return lam_B.clamp(0.0, 1.0)


def length_adaptive_lambda(action_mask_BT: torch.Tensor, *, alpha: float) -> torch.Tensor:
    """Per-row ``lam = 1 - 1 / (alpha * l)``, ``l`` = number of action tokens.

    See :func:`adaptive_lambda` for the source and the clamping [choice]
    (``l = 0`` or ``alpha * l < 1`` gives 0).

    Shapes: ``action_mask_BT`` [B, T] bool -> ``lam_B`` [B] float32.
    """
    check_ndim("action_mask_BT", action_mask_BT, 2, "[B, T]")
    mask_BT = check_mask("action_mask_BT", action_mask_BT)
    return adaptive_lambda(mask_BT.sum(dim=1), alpha=alpha)


# --------------------------------------------------------------------------- token GAE


def gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    action_mask_BT: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float | torch.Tensor,
    truncated_B: torch.Tensor | None = None,
    truncation: Truncation = "bootstrap",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Skip-observation token-level GAE (ALGORITHMS.md section 3) [paper].

    Action tokens ``t_0 < t_1 < ... < t_{n-1}`` of a row form one chain;
    observation, prompt and padding positions are not states of the policy:

    - ``delta_k = r_{t_k} + gamma * V_{t_{k+1}} - V_{t_k}`` (across an
      observation gap too), ``A_k = delta_k + gamma * lam * A_{k+1}``
      (GAE, Schulman et al. 2016, eq. 16);
    - terminal step: ``V_{t_n} = 0`` for finished episodes; for a row with
      ``truncated_B`` True, ``truncation="bootstrap"`` [choice, default] uses
      the value at the cut, ``V_{t_n} := V_{t_{n-1}}`` (so
      ``delta_{n-1} = r + gamma * V_last - V_last``), and ``"zero"`` treats the
      cut as terminal. (Dropping truncated rows is the caller's loss mask.)
    - ``returns = advantages + values`` on action tokens; with ``lam = 1`` this
      is the Monte-Carlo return (the critic target, ALGORITHMS.md section 3).

    Rewards must sit on action tokens (``collate`` puts each on a turn's last
    action token); a nonzero reward elsewhere is an error, not silently lost.

    Args:
        rewards_BT: [B, T] per-token rewards.
        values_BT: [B, T] critic values; read only where ``action_mask_BT``.
        action_mask_BT: [B, T] bool, True on policy-sampled tokens.
        gamma: discount in [0, 1] (default 1 [choice]).
        lam: float in [0, 1] or a per-row [B] tensor
            (e.g. :func:`length_adaptive_lambda`).
        truncated_B: [B] bool, rows cut by a length limit; None = none.
        truncation: ``"bootstrap"`` or ``"zero"`` (see above).

    Returns:
        ``(advantages_BT, returns_BT)``, both [B, T], 0 outside the action
        mask. Computed in float32 (float64 for float64 inputs) and returned in
        ``promote_types(rewards_BT.dtype, values_BT.dtype)`` (float32 if both
        are integer). They are targets: inputs are detached, no gradient flows.
    """
    mask_BT, lam_B, bootstrap_B, out_dtype = _validate(
        rewards_BT, values_BT, action_mask_BT, gamma, lam, truncated_B, truncation
    )
    compute = _compute_dtype(out_dtype)
    rewards_BT, values_BT = rewards_BT.detach().to(compute), values_BT.detach().to(compute)
    adv_BT, ret_BT = _skip_gae(
        rewards_BT, values_BT, mask_BT, gamma, lam_B.to(compute), bootstrap_B
    )
    return adv_BT.to(out_dtype), ret_BT.to(out_dtype)


# --------------------------------------------------------------------------- step GAE


def count_turns(turn_id_BT: torch.Tensor, action_mask_BT: torch.Tensor) -> torch.Tensor:
    """Number of turns with at least one action token, per row.

    Feed it to :func:`adaptive_lambda` for the step-level lambda
    ``1 - 1 / (alpha * number_of_turns)`` (ALGORITHMS.md section 3).

    Shapes: ``turn_id_BT`` [B, T] long (turn index on action tokens, -1
    elsewhere, as built by ``sao.types.collate``), ``action_mask_BT`` [B, T]
    -> [B] long.
    """
    check_ndim("action_mask_BT", action_mask_BT, 2, "[B, T]")
    check_same_shape(action_mask_BT=action_mask_BT, turn_id_BT=turn_id_BT)
    mask_BT = check_mask("action_mask_BT", action_mask_BT)
    _check_turn_ids(turn_id_BT, mask_BT)
    tid_BT, K = _turn_slots(turn_id_BT, mask_BT)
    count_BK = _per_turn_sum(mask_BT.long(), tid_BT, K)
    return (count_BK > 0).sum(dim=1)


def step_level_gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    action_mask_BT: torch.Tensor,
    turn_id_BT: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float | torch.Tensor,
    turn_value: TurnValue = "average",
    truncated_B: torch.Tensor | None = None,
    truncation: Truncation = "bootstrap",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step-level GAE over turns: the paper's baselines (App. A.1,
    ALGORITHMS.md section 3 "Step-level variants").

    For the turns ``i = 0..K-1`` of a row (turns with no action token are
    skipped): ``R_i`` = sum of ``rewards_BT`` over the turn's action tokens;
    ``V(S_i)`` = mean of its token values (``turn_value="average"``) or the
    value at its last token (``"last_token"``). Then step TD
    ``delta_i = R_i + gamma * V(S_{i+1}) - V(S_i)`` and GAE over turns, with
    the same terminal / truncation rule as :func:`gae` applied to the last
    turn. One advantage per turn is broadcast to all of the turn's tokens.

    Args:
        rewards_BT, values_BT, action_mask_BT, gamma, lam, truncated_B,
        truncation: as in :func:`gae` (``lam`` per row, e.g.
            ``adaptive_lambda(count_turns(...), alpha=...)``).
        turn_id_BT: [B, T] integer turn index of each action token (>= 0,
            non-decreasing along a row's action tokens); ignored elsewhere.
        turn_value: ``"average"`` or ``"last_token"``.

    Returns:
        ``(advantages_BT, returns_BT, critic_mask_BT)``: the turn advantage and
        the turn return ``A_i + V(S_i)`` on each of the turn's tokens (0
        elsewhere), and where the critic is trained: every action token for
        ``"average"``, only each turn's last token for ``"last_token"``.
    """
    check_choice("turn_value", turn_value, _TURN_VALUES)
    mask_BT, lam_B, bootstrap_B, out_dtype = _validate(
        rewards_BT, values_BT, action_mask_BT, gamma, lam, truncated_B, truncation
    )
    check_same_shape(rewards_BT=rewards_BT, turn_id_BT=turn_id_BT)
    _check_turn_ids(turn_id_BT, mask_BT)
    compute = _compute_dtype(out_dtype)
    tid_BT, K = _turn_slots(turn_id_BT, mask_BT)
    rewards_BT, values_BT = rewards_BT.detach().to(compute), values_BT.detach().to(compute)
    rewards_BK, values_BK, present_BK, critic_mask_BT = _per_turn(
        rewards_BT, values_BT, mask_BT, tid_BT, K, turn_value
    )
    adv_BK, ret_BK = _skip_gae(
        rewards_BK, values_BK, present_BK, gamma, lam_B.to(compute), bootstrap_B
    )
    adv_BT = _gather_slots(adv_BK, tid_BT)
    ret_BT = _gather_slots(ret_BK, tid_BT)
    return adv_BT.to(out_dtype), ret_BT.to(out_dtype), critic_mask_BT


def _per_turn(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    tid_BT: torch.Tensor,
    K: int,
    turn_value: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turn rewards R_i [B, K], turn values V(S_i) [B, K], which turns have a
    token [B, K], and the critic mask [B, T] (App. A.1)."""
    zero = torch.zeros((), dtype=values_BT.dtype, device=values_BT.device)
    values_BT = torch.where(mask_BT, values_BT, zero)  # NaN off the actions stays out
    rewards_BK = _per_turn_sum(torch.where(mask_BT, rewards_BT, zero), tid_BT, K)
    count_BK = _per_turn_sum(mask_BT.long(), tid_BT, K)
    if turn_value == "average":
        values_BK = _per_turn_sum(values_BT, tid_BT, K) / count_BK.clamp(min=1)
        return rewards_BK, values_BK, count_BK > 0, mask_BT
    pos_BT = torch.arange(mask_BT.shape[1], device=mask_BT.device).expand_as(tid_BT)
    last_BK = torch.full((tid_BT.shape[0], K + 1), -1, device=tid_BT.device)
    last_BK = last_BK.scatter_reduce(1, tid_BT, torch.where(mask_BT, pos_BT, -1), reduce="amax")
    last_BK = last_BK[:, :K]
    values_BK = torch.gather(values_BT, 1, last_BK.clamp(min=0))
    critic_mask_BT = mask_BT & (pos_BT == _gather_slots(last_BK, tid_BT))
    return rewards_BK, values_BK, count_BK > 0, critic_mask_BT


# --------------------------------------------------------------------------- internals


def _validate(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    action_mask_BT: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
    truncated_B: torch.Tensor | None,
    truncation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]:
    """Shared checks of gae / step_level_gae. Returns the bool mask, lam as [B],
    the per-row "bootstrap at the end" flags and the output dtype."""
    check_ndim("rewards_BT", rewards_BT, 2, "[B, T]")
    check_same_shape(rewards_BT=rewards_BT, values_BT=values_BT, action_mask_BT=action_mask_BT)
    mask_BT = check_mask("action_mask_BT", action_mask_BT).to(values_BT.device)
    check_range("gamma", gamma, low=0.0, high=1.0)
    check_choice("truncation", truncation, _TRUNCATIONS)
    check_finite("values_BT", values_BT, mask_BT)
    check_finite("rewards_BT", rewards_BT, mask_BT)
    off_action = int(((rewards_BT != 0) & ~mask_BT).sum())
    if off_action:
        raise ValueError(
            f"rewards_BT has {off_action} nonzero value(s) outside action_mask_BT; every "
            "reward must sit on an action token (collate puts it on the turn's last one)"
        )
    B = rewards_BT.shape[0]
    lam_B = _lam_per_row(lam, B, values_BT.device)
    bootstrap_B = torch.zeros(B, dtype=torch.bool, device=values_BT.device)
    if truncated_B is not None:
        check_ndim("truncated_B", truncated_B, 1, "[B]")
        if truncated_B.shape[0] != B:
            raise ValueError(f"truncated_B has {truncated_B.shape[0]} rows, expected B={B}")
        if truncation == "bootstrap":
            bootstrap_B = check_mask("truncated_B", truncated_B).to(values_BT.device)
    out_dtype = torch.promote_types(rewards_BT.dtype, values_BT.dtype)
    if not out_dtype.is_floating_point:
        out_dtype = torch.float32
    return mask_BT, lam_B, bootstrap_B, out_dtype


def _lam_per_row(lam: float | torch.Tensor, B: int, device: torch.device) -> torch.Tensor:
    """``lam`` as a float64 [B] tensor, checked to lie in [0, 1]."""
    if isinstance(lam, torch.Tensor):
        if lam.ndim == 0:
            return _lam_per_row(float(lam), B, device)
        check_ndim("lam", lam, 1, "a float or a [B] tensor")
        if lam.shape[0] != B:
            raise ValueError(f"lam has {lam.shape[0]} entries, expected one per row (B={B})")
        lam_B = lam.to(device=device, dtype=torch.float64)
        if not bool((torch.isfinite(lam_B) & (lam_B >= 0) & (lam_B <= 1)).all()):
            raise ValueError("lam must be in [0, 1] for every row, got values outside it")
        return lam_B
    check_range("lam", float(lam), low=0.0, high=1.0)
    return torch.full((B,), float(lam), dtype=torch.float64, device=device)


def _compute_dtype(out_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if out_dtype == torch.float64 else torch.float32


def _skip_gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float,
    lam_B: torch.Tensor,
    bootstrap_B: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack masked positions left, run plain GAE, scatter back (0 elsewhere)."""
    B, T = mask_BT.shape
    length_B = mask_BT.sum(dim=1)
    L = int(length_B.max()) if B > 0 and T > 0 else 0
    if L == 0:
        zeros_BT = torch.zeros_like(values_BT)
        return zeros_BT, zeros_BT.clone()
    # slot = rank among the row's masked positions; unmasked positions go to a
    # spare column L, which is written with zeros and dropped.
    slot_BT = torch.where(mask_BT, mask_BT.long().cumsum(dim=1) - 1, L)
    zero = torch.zeros((), dtype=values_BT.dtype, device=values_BT.device)

    def pack(x_BT: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((B, L + 1), dtype=x_BT.dtype, device=x_BT.device)
        return out.scatter_(1, slot_BT, torch.where(mask_BT, x_BT, zero))[:, :L]

    values_BL = pack(values_BT)
    adv_BL = _packed_gae(pack(rewards_BT), values_BL, length_B, gamma, lam_B, bootstrap_B)
    return _gather_slots(adv_BL, slot_BT), _gather_slots(adv_BL + values_BL, slot_BT)


def _packed_gae(
    rewards_BL: torch.Tensor,
    values_BL: torch.Tensor,
    length_B: torch.Tensor,
    gamma: float,
    lam_B: torch.Tensor,
    bootstrap_B: torch.Tensor,
) -> torch.Tensor:
    """Plain GAE on left-packed rows of ``length_B`` steps; 0 past the end.

    ``values_BL`` must be 0 past each row's end (``pack`` guarantees it), so
    ``V_{k+1}`` for the last step is 0 unless the row bootstraps, where it is
    ``V_last``.
    """
    B, L = values_BL.shape
    next_BL = torch.cat([values_BL[:, 1:], values_BL.new_zeros(B, 1)], dim=1)
    is_last_BL = torch.arange(L, device=values_BL.device) == (length_B - 1)[:, None]
    next_BL = torch.where(is_last_BL & bootstrap_B[:, None], values_BL, next_BL)
    valid_BL = torch.arange(L, device=values_BL.device) < length_B[:, None]
    delta_BL = torch.where(valid_BL, rewards_BL + gamma * next_BL - values_BL, 0.0)
    # Reverse scan A_k = delta_k + gamma*lam*A_{k+1}; past the end delta = 0, so
    # A = 0 there and each row's chain starts from 0. [L, B] keeps rows contiguous.
    decay_B = (gamma * lam_B).to(values_BL.dtype)
    delta_LB = delta_BL.t().contiguous()
    adv_LB = torch.empty_like(delta_LB)
    running_B = torch.zeros_like(decay_B)
    for k in range(L - 1, -1, -1):
        running_B = torch.addcmul(delta_LB[k], decay_B, running_B)
        adv_LB[k] = running_B
    return adv_LB.t()


def _gather_slots(x_BK: torch.Tensor, slot_BT: torch.Tensor) -> torch.Tensor:
    """``out[b, t] = x[b, slot[b, t]]``; slot == K (the spare column) gives 0.
    Unpacks GAE results and broadcasts per-turn results to their tokens."""
    padded = torch.cat([x_BK, x_BK.new_zeros(x_BK.shape[0], 1)], dim=1)
    return torch.gather(padded, 1, slot_BT)


def _check_turn_ids(turn_id_BT: torch.Tensor, mask_BT: torch.Tensor) -> None:
    if turn_id_BT.is_floating_point() or turn_id_BT.dtype == torch.bool:
        raise ValueError(f"turn_id_BT must be an integer tensor, got dtype {turn_id_BT.dtype}")
    tid_BT = torch.where(mask_BT, turn_id_BT.to(mask_BT.device).long(), -1)
    if bool((mask_BT & (tid_BT < 0)).any()):
        raise ValueError("turn_id_BT must be >= 0 on every action token (it is -1 elsewhere)")
    # An earlier action token with a larger id means turns out of order.
    if bool((mask_BT & (tid_BT < tid_BT.cummax(dim=1).values)).any()):
        raise ValueError("turn_id_BT must be non-decreasing along each row's action tokens")


def _turn_slots(turn_id_BT: torch.Tensor, mask_BT: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Turn index per position with non-action positions sent to spare column K."""
    tid_BT = turn_id_BT.to(mask_BT.device).long()
    K = int(tid_BT[mask_BT].max()) + 1 if bool(mask_BT.any()) else 0
    return torch.where(mask_BT, tid_BT, K), K


def _per_turn_sum(x_BT: torch.Tensor, tid_BT: torch.Tensor, K: int) -> torch.Tensor:
    out = torch.zeros((x_BT.shape[0], K + 1), dtype=x_BT.dtype, device=x_BT.device)
    return out.scatter_add_(1, tid_BT, x_BT)[:, :K]
