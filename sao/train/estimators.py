"""The config edge: preset names -> ``sao.algo`` functions.

This is the only place that branches on an algorithm's name; each branch is
one call of a pure function from ``sao.algo``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from sao.algo.advantages import (
    adaptive_lambda,
    count_turns,
    gae,
    length_adaptive_lambda,
    step_level_gae,
)
from sao.algo.baselines import (
    RunningMeanBaseline,
    broadcast_to_tokens,
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from sao.algo.losses import (
    cispo_loss,
    dis_loss,
    gspo_loss,
    icepop_mask,
    ppo_clip_loss,
    tis_weights,
)
from sao.algo.presets import AlgoPreset
from sao.algo.stats import explained_variance, masked_mean, masked_var
from sao.types import Batch

Stats = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Targets:
    """What the update needs: actor advantages, critic targets and where the
    critic is trained (``returns_BT`` / ``critic_mask_BT`` are None without a
    critic). Shapes ``[B, T]``."""

    advantages_BT: torch.Tensor
    returns_BT: torch.Tensor | None
    critic_mask_BT: torch.Tensor | None
    critic_baseline: bool | None = None
    """With ``algo.ev_gate``: whether the critic gave the advantages (else the batch mean)."""


def group_index(group_ids: tuple[str, ...], device: torch.device | None = None) -> torch.Tensor:
    """String group ids -> a ``[B]`` long tensor of small integers (on ``device``)."""
    index: dict[str, int] = {}
    ids = [index.setdefault(g, len(index)) for g in group_ids]
    return torch.tensor(ids, dtype=torch.long, device=device)


def actor_lambda(algo: AlgoPreset, batch: Batch) -> float | torch.Tensor:
    """Fixed ``lam_actor``, or the length-adaptive ``1 - 1/(alpha * l)`` per row
    (per turn count for step-level GAE)."""
    if algo.lam_actor is not None:
        return algo.lam_actor
    if algo.advantage in ("step_average", "step_last_token"):
        turns_B = count_turns(batch.turn_id_BT, batch.action_mask_BT)
        return adaptive_lambda(turns_B, alpha=algo.lam_alpha)
    return length_adaptive_lambda(batch.action_mask_BT, alpha=algo.lam_alpha)


def compute_targets(
    algo: AlgoPreset,
    batch: Batch,
    values_BT: torch.Tensor | None,
    running_mean: RunningMeanBaseline | None,
) -> Targets:
    """Advantages (and critic targets) for the preset's estimator (ALGORITHMS.md 3-5)."""
    if algo.advantage in ("gae", "step_average", "step_last_token"):
        assert values_BT is not None, f"advantage={algo.advantage!r} needs critic values"
        return _critic_targets(algo, batch, values_BT)
    mask = batch.action_mask_BT
    rewards_B = batch.rewards_B
    if algo.advantage == "group":
        adv_B = group_advantages(
            rewards_B,
            group_index(batch.group_ids, rewards_B.device),
            normalize_std=algo.normalize_std,
        )
    elif algo.advantage == "rloo":
        adv_B = rloo_advantages(rewards_B, group_index(batch.group_ids, rewards_B.device))
    elif algo.advantage == "reinforce_pp":
        groups = group_index(batch.group_ids, rewards_B.device) if algo.group_size > 1 else None
        adv_B = reinforce_pp_advantages(rewards_B, group_ids_B=groups)
    elif algo.advantage == "running_mean":
        assert running_mean is not None
        adv_B = running_mean.advantages(rewards_B, batch.prompt_ids)
    else:  # pragma: no cover - AlgoPreset's Literal makes this unreachable
        raise ValueError(f"unknown advantage estimator {algo.advantage!r}")
    return Targets(_whiten(algo, broadcast_to_tokens(adv_B, mask), mask), None, None)


CRITIC_ADVANTAGES = ("gae", "step_average", "step_last_token")
"""Estimators whose advantages and critic targets come from the critic's values."""


def _critic_targets(algo: AlgoPreset, batch: Batch, values_BT: torch.Tensor) -> Targets:
    """Token GAE or step-level GAE: decoupled lambdas (actor adaptive, critic 1); with
    ``algo.ev_gate`` the batch mean instead when the critic explains no variance."""
    mask = batch.action_mask_BT
    ret, critic_mask = critic_returns(algo, batch, values_BT)
    use_critic = critic_explains(values_BT, ret, critic_mask) if algo.ev_gate else True
    if use_critic:
        adv = _critic_gae(algo, batch, values_BT, actor_lambda(algo, batch))[0]
    else:
        adv = broadcast_to_tokens(batch.rewards_B - batch.rewards_B.mean(), mask)
    gate = use_critic if algo.ev_gate else None
    return Targets(_whiten(algo, adv, mask), ret, critic_mask, critic_baseline=gate)


def critic_explains(
    values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor
) -> bool:
    """EVPO's test: the critic's explained variance of ``returns_BT`` over the masked
    tokens is above 0, so ``R - V`` varies less than ``R - mean R`` (False when the
    returns are all equal: the batch mean's advantages are then 0, the critic's noise)."""
    ev = explained_variance(values_BT, returns_BT, mask_BT)
    return bool(torch.isfinite(ev) and ev > 0)


def critic_returns(
    algo: AlgoPreset, batch: Batch, values_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's targets ``[B, T]`` (lambda = ``lam_critic``, ALGORITHMS.md 3) and
    where it is trained ``[B, T]``. Row-local: a micro-batch's rows get the
    same numbers as in the whole batch (what ``Trainer`` relies on to take
    the first critic update's returns from that update's own forward)."""
    _, ret, critic_mask = _critic_gae(algo, batch, values_BT, algo.lam_critic)
    return ret, critic_mask


def gae_gap(algo: AlgoPreset, batch: Batch, values_BT: torch.Tensor) -> Stats:
    """How far the paper's length-adaptive token GAE moves the actor's advantages
    away from Monte-Carlo ones (lambda 1, ``R - V(s_t)``), on this batch's action
    tokens: ``critic/gae_gap_rms`` = RMS(A_adaptive - A_mc) against
    ``critic/mc_adv_rms`` = RMS(A_mc). Whatever lambda the actor uses, this is what
    the critic's token-to-token differences would add: with a critic that knows
    little, mostly noise (a gap as large as the Monte-Carlo advantages themselves
    swamps their signal). Empty for estimators other than token GAE."""
    mask = batch.action_mask_BT
    if algo.advantage != "gae" or not bool(mask.any()):
        return {}
    lam = length_adaptive_lambda(mask, alpha=algo.lam_alpha)
    adaptive = _critic_gae(algo, batch, values_BT, lam)[0]
    mc = _critic_gae(algo, batch, values_BT, 1.0)[0]
    gap = masked_mean((adaptive - mc) ** 2, mask).sqrt()
    return {"critic/gae_gap_rms": gap, "critic/mc_adv_rms": masked_mean(mc**2, mask).sqrt()}


def critic_mask(algo: AlgoPreset, batch: Batch) -> torch.Tensor:
    """Where :func:`critic_returns` trains the critic ``[B, T]``, before any value
    exists: the action tokens, or each turn's last one for ``step_last_token``."""
    if algo.advantage == "step_last_token":  # the mask does not depend on the values
        return critic_returns(algo, batch, torch.zeros_like(batch.rewards_BT))[1]
    return batch.action_mask_BT


def _critic_gae(
    algo: AlgoPreset, batch: Batch, values_BT: torch.Tensor, lam: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages, returns, critic mask) of token or step-level GAE at ``lam``."""
    mask = batch.action_mask_BT
    trunc_B, how = batch.truncated_B, _gae_truncation(algo)
    if algo.advantage == "gae":
        adv, ret = gae(
            batch.rewards_BT,
            values_BT,
            mask,
            gamma=algo.gamma,
            lam=lam,
            truncated_B=trunc_B,
            truncation=how,
        )
        return adv, ret, mask
    if algo.advantage in ("step_average", "step_last_token"):
        turn_value: Literal["average", "last_token"] = (
            "average" if algo.advantage == "step_average" else "last_token"
        )
        return step_level_gae(
            batch.rewards_BT,
            values_BT,
            mask,
            batch.turn_id_BT,
            gamma=algo.gamma,
            lam=lam,
            turn_value=turn_value,
            truncated_B=trunc_B,
            truncation=how,
        )
    raise ValueError(f"advantage {algo.advantage!r} does not use a critic")


def _gae_truncation(algo: AlgoPreset) -> Literal["bootstrap", "zero"]:
    # 'drop' removes truncated rows before collation; what reaches GAE is terminal.
    return "zero" if algo.truncation == "drop" else algo.truncation


def _whiten(algo: AlgoPreset, adv_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    if not algo.whiten_advantages or int(mask_BT.sum()) < 2:
        return adv_BT
    std = masked_var(adv_BT, mask_BT).clamp(min=1e-12).sqrt()
    return torch.where(mask_BT, (adv_BT - masked_mean(adv_BT, mask_BT)) / std, 0.0)


def needs_old_logp(algo: AlgoPreset) -> bool:
    """PPO-family losses compare against the trainer's pre-update policy."""
    return algo.loss != "dis"


def policy_loss(
    algo: AlgoPreset,
    logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor | None,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    denom: float,
) -> tuple[torch.Tensor, Stats]:
    """The preset's policy loss on one micro-batch (``denom``: the whole batch's)."""
    eps = dict(eps_low=algo.eps_low, eps_high=algo.eps_high)
    if algo.loss == "dis":
        return dis_loss(
            logp_BT,
            rollout_logp_BT,
            advantages_BT,
            mask_BT,
            reduction=algo.reduction,
            denom=denom,
            **eps,
        )
    assert old_logp_BT is not None
    if algo.loss == "gspo":
        return gspo_loss(logp_BT, old_logp_BT, advantages_BT, mask_BT, denom=denom, **eps)
    if algo.loss == "cispo":
        return cispo_loss(
            logp_BT,
            old_logp_BT,
            advantages_BT,
            mask_BT,
            reduction=algo.reduction,
            denom=denom,
            **eps,
        )
    weights = None
    if algo.correction == "tis":
        weights = tis_weights(old_logp_BT, rollout_logp_BT)
    elif algo.correction == "icepop":
        weights = icepop_mask(old_logp_BT, rollout_logp_BT)
    return ppo_clip_loss(
        logp_BT,
        old_logp_BT,
        advantages_BT,
        mask_BT,
        token_weights_BT=weights,
        reduction=algo.reduction,
        denom=denom,
        **eps,
    )
