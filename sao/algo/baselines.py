"""Critic-free advantage estimators and reward shaping: GRPO / Dr.GRPO group
normalisation, RLOO, REINFORCE++, the running-mean baseline of the paper's
ablations, and DAPO's dynamic sampling and overlong penalty.

Sequence-level estimators take ``rewards_B`` [B] and return ``advantages_B``
[B]; :func:`broadcast_to_tokens` spreads them over the action tokens. Groups
are given as ``group_ids_B`` [B] integer ids (any values, not necessarily
contiguous or sorted). Computation is in float32 (float64 for float64 input);
results come back in the rewards' float dtype (float32 for integer rewards).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from sao.algo._checks import check_finite, check_mask, check_ndim, check_range


def group_advantages(
    rewards_B: torch.Tensor,
    group_ids_B: torch.Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO: ``A_i = (R_i - mean_G) / (std_G + eps)`` within each group G.

    DeepSeekMath (Shao et al. 2024, arXiv 2402.03300), section 4.1.2 "outcome
    supervision"; ``normalize_std=False`` gives Dr.GRPO's ``A_i = R_i - mean_G``
    (Liu et al. 2025, arXiv 2503.20783, "Understanding R1-Zero-Like Training").

    [choice] ``std_G`` is the unbiased (n - 1) standard deviation, as
    ``torch.std`` in common GRPO implementations (TRL, verl). A singleton group
    has no spread to compare against and gets advantage 0; a group whose
    rewards are all equal gets 0 too.

    Shapes: ``rewards_B`` [B], ``group_ids_B`` [B] integer -> [B].
    """
    check_range("eps", eps, low=0.0)
    x_B, out_dtype = _as_float(rewards_B, "rewards_B")
    inverse_B, count_B, mean_B = _group_stats(x_B, group_ids_B)
    centered_B = torch.where(count_B > 1, x_B - mean_B, 0.0)
    if not normalize_std:
        return centered_B.to(out_dtype)
    # (a [B] buffer: there are at most B groups)
    sq_sum_G = torch.zeros_like(x_B).index_add_(0, inverse_B, centered_B.square())
    var_B = sq_sum_G[inverse_B] / (count_B - 1).clamp(min=1)
    return (centered_B / (var_B.sqrt() + eps)).to(out_dtype)


def rloo_advantages(rewards_B: torch.Tensor, group_ids_B: torch.Tensor) -> torch.Tensor:
    """RLOO: ``A_i = R_i - mean_{j in G, j != i} R_j`` (leave-one-out baseline).

    Kool et al. 2019 ("Buy 4 REINFORCE samples, get a baseline for free!");
    Ahmadian et al. 2024 (arXiv 2402.14740), section 3. A singleton group has no
    other member and gets advantage 0.

    Shapes: ``rewards_B`` [B], ``group_ids_B`` [B] integer -> [B].
    """
    x_B, out_dtype = _as_float(rewards_B, "rewards_B")
    _, count_B, mean_B = _group_stats(x_B, group_ids_B)
    # R_i - (n*mean - R_i)/(n - 1) = n/(n - 1) * (R_i - mean)
    n_B = count_B.to(x_B.dtype)
    adv_B = torch.where(count_B > 1, n_B / (n_B - 1).clamp(min=1) * (x_B - mean_B), 0.0)
    return adv_B.to(out_dtype)


def reinforce_pp_advantages(
    rewards_B: torch.Tensor,
    *,
    group_ids_B: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """REINFORCE++: ``A = (x - mean_batch(x)) / (std_batch(x) + eps)``.

    Hu 2025 (arXiv 2501.03262), global batch advantage normalisation, with
    ``x = R``; with ``group_ids_B`` given, ``x = R - mean_G(R)`` first
    (REINFORCE++-baseline).

    [choice] Normalisation is over sequences (each row counts once), with the
    unbiased std; with gamma = 1 and an outcome reward this matches the
    token-level version up to the weighting by length. A batch of one row gets
    advantage 0.

    Shapes: ``rewards_B`` [B], optional ``group_ids_B`` [B] integer -> [B].
    """
    check_range("eps", eps, low=0.0)
    x_B, out_dtype = _as_float(rewards_B, "rewards_B")
    if group_ids_B is not None:
        _, _, mean_B = _group_stats(x_B, group_ids_B)
        x_B = x_B - mean_B
    if x_B.numel() < 2:
        return torch.zeros_like(x_B).to(out_dtype)
    return ((x_B - x_B.mean()) / (x_B.std() + eps)).to(out_dtype)


def broadcast_to_tokens(advantages_B: torch.Tensor, action_mask_BT: torch.Tensor) -> torch.Tensor:
    """Each row's advantage on every action token, 0 elsewhere.

    Shapes: ``advantages_B`` [B], ``action_mask_BT`` [B, T] -> [B, T] in the
    advantages' dtype.
    """
    check_ndim("advantages_B", advantages_B, 1, "[B]")
    check_ndim("action_mask_BT", action_mask_BT, 2, "[B, T]")
    if action_mask_BT.shape[0] != advantages_B.shape[0]:
        raise ValueError(
            f"advantages_B has {advantages_B.shape[0]} rows but action_mask_BT has "
            f"{action_mask_BT.shape[0]}; they must match"
        )
    mask_BT = check_mask("action_mask_BT", action_mask_BT).to(advantages_B.device)
    check_finite("advantages_B", advantages_B, mask_BT.any(dim=1))
    zero = torch.zeros((), dtype=advantages_B.dtype, device=advantages_B.device)
    return torch.where(mask_BT, advantages_B[:, None], zero)


def dynamic_sampling_mask(rewards_B: torch.Tensor, group_ids_B: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: keep a row iff its group's rewards are not all equal.

    Yu et al. 2025 (arXiv 2503.14476), the constraint of the DAPO objective
    ``0 < |{o_i : is_equivalent(a, o_i)}| < G``, generalised to any reward:
    a group whose rewards are all (exactly) equal has zero group-normalised
    advantage and is dropped. A singleton group is all-equal and is dropped.

    Shapes: ``rewards_B`` [B], ``group_ids_B`` [B] integer -> ``keep_B`` [B] bool.
    """
    x_B, _ = _as_float(rewards_B, "rewards_B")
    inverse_B, _, _ = _group_stats(x_B, group_ids_B)
    n_groups = int(inverse_B.max()) + 1 if x_B.numel() else 0
    lo_G = torch.full((n_groups,), float("inf"), dtype=x_B.dtype, device=x_B.device)
    hi_G = torch.full((n_groups,), float("-inf"), dtype=x_B.dtype, device=x_B.device)
    lo_G = lo_G.scatter_reduce(0, inverse_B, x_B, reduce="amin")
    hi_G = hi_G.scatter_reduce(0, inverse_B, x_B, reduce="amax")
    return (hi_G > lo_G)[inverse_B]


def overlong_penalty(lengths_B: torch.Tensor, *, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13).

    ``0`` if ``l <= max_len - cache_len``; ``((max_len - cache_len) - l) / cache_len``
    if ``max_len - cache_len < l <= max_len`` (from 0 down to -1); ``-1`` if
    ``l > max_len``. Add it to the task reward.

    Shapes: ``lengths_B`` [B] (response lengths in tokens) -> ``penalty_B`` [B]
    float32. Requires ``0 < cache_len <= max_len``.
    """
    check_range("max_len", max_len, low=0.0, low_open=True)
    check_range("cache_len", cache_len, low=0.0, high=max_len, low_open=True)
    check_ndim("lengths_B", lengths_B, 1, "[B]")
    check_finite("lengths_B", lengths_B)
    l_B = lengths_B.to(torch.float64)
    soft = max_len - cache_len
    penalty_B = torch.where(l_B <= soft, 0.0, (soft - l_B) / cache_len)
    return torch.where(l_B > max_len, -1.0, penalty_B).to(torch.float32)


class RunningMeanBaseline:
    """``A_i = R_i - mean(previous rewards)``: the paper's running-mean ablation
    (ALGORITHMS.md section 5): window 8 per prompt, or 128 over all prompts in
    the online-shift setting (section 7).

    ``advantages`` uses only rewards from earlier calls (rows of one batch do
    not see each other [choice]), then appends this batch's rewards in order.
    [choice] A prompt seen for the first time is baselined by the global
    window (the last ``window`` rewards overall): tasks that draw a fresh
    problem for every episode, like the built-in ones, would otherwise get no
    signal at all. With no history whatsoever the advantage is 0.
    """

    def __init__(self, window: int, per_prompt: bool) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.window = window
        self.per_prompt = per_prompt
        self._history: dict[str, deque[float]] = {}
        self._global: deque[float] = deque(maxlen=window)

    def _past(self, prompt_id: str) -> deque[float]:
        own = self._history.get(prompt_id) if self.per_prompt else None
        return own if own else self._global

    def advantages(self, rewards_B: torch.Tensor, prompt_ids: Sequence[str]) -> torch.Tensor:
        """Shapes: ``rewards_B`` [B], ``prompt_ids`` B strings -> [B]."""
        x_B, out_dtype = _as_float(rewards_B, "rewards_B")
        if len(prompt_ids) != x_B.shape[0]:
            raise ValueError(
                f"prompt_ids has {len(prompt_ids)} entries but rewards_B has {x_B.shape[0]}"
            )
        baseline = []
        for pid, r in zip(prompt_ids, x_B.tolist(), strict=True):
            past = self._past(pid)
            baseline.append(sum(past) / len(past) if past else r)
        adv_B = x_B - torch.tensor(baseline, dtype=x_B.dtype, device=x_B.device)
        for pid, r in zip(prompt_ids, x_B.tolist(), strict=True):
            self._global.append(r)
            if self.per_prompt:
                self._history.setdefault(pid, deque(maxlen=self.window)).append(r)
        return adv_B.to(out_dtype)

    def state_dict(self) -> dict[str, object]:
        """JSON-serialisable state: window, mode, the per-prompt windows and the global one."""
        history = {k: list(v) for k, v in self._history.items()}
        return {
            "window": self.window,
            "per_prompt": self.per_prompt,
            "history": history,
            "global": list(self._global),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore from :meth:`state_dict`. The mode must match; a saved window
        longer than ``self.window`` keeps only its most recent rewards."""
        if bool(state.get("per_prompt")) != self.per_prompt:
            raise ValueError(
                f"state per_prompt={state.get('per_prompt')!r} does not match "
                f"this baseline's per_prompt={self.per_prompt}"
            )
        history = state.get("history")
        if not isinstance(history, dict):
            raise ValueError("state['history'] must be a dict of prompt id -> list of rewards")
        glob = state.get("global", [])
        if not isinstance(glob, list):
            raise ValueError("state['global'] must be a list of rewards")
        self._history = {
            str(k): deque((float(r) for r in v), maxlen=self.window) for k, v in history.items()
        }
        self._global = deque((float(r) for r in glob), maxlen=self.window)


# --------------------------------------------------------------------------- internals


def _as_float(rewards_B: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.dtype]:
    """Checked [B] rewards in the compute dtype, plus the dtype to return."""
    check_ndim(name, rewards_B, 1, "[B]")
    check_finite(name, rewards_B)
    out_dtype = rewards_B.dtype if rewards_B.is_floating_point() else torch.float32
    compute = torch.float64 if out_dtype == torch.float64 else torch.float32
    return rewards_B.to(compute), out_dtype


def _group_stats(
    x_B: torch.Tensor, group_ids_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: dense group index, group size and group mean."""
    check_ndim("group_ids_B", group_ids_B, 1, "[B]")
    if group_ids_B.shape[0] != x_B.shape[0]:
        raise ValueError(
            f"group_ids_B has {group_ids_B.shape[0]} entries but rewards_B has {x_B.shape[0]}"
        )
    if group_ids_B.is_floating_point() or group_ids_B.dtype == torch.bool:
        raise ValueError(f"group_ids_B must be an integer tensor, got dtype {group_ids_B.dtype}")
    _, inverse_B, count_G = torch.unique(
        group_ids_B.to(x_B.device), return_inverse=True, return_counts=True
    )
    sum_G = torch.zeros(count_G.shape[0], dtype=x_B.dtype, device=x_B.device)
    sum_G.index_add_(0, inverse_B, x_B)
    count_B = count_G[inverse_B]
    return inverse_B, count_B, sum_G[inverse_B] / count_B
