"""How well the critic predicts returns it has not been trained on.

Each batch's values come from the critic *before* it trains on that batch,
so its value at an episode's first action token (the state after the prompt)
is an out-of-sample prediction of the episode's return. Pooled over the last
``window`` episodes this is a held-out reading at no extra forward, far less
noisy than one batch's ``critic/explained_variance`` (at batch 16 a critic
that knows the prompt classes exactly reads anywhere in -0.06..0.25 on
SmolLM2 arithmetic; BENCHMARKS.md).

The trivial baseline it is judged against is the running mean of all returns
recorded before the episode's batch, also out of sample:

    heldout_gain = 1 - sum (R - V)^2 / sum (R - mean_before)^2

> 0: the critic beats the running mean (a constant baseline learned online);
<= 0: its baseline is no better than that, and its token-to-token differences
are noise in GAE's advantages. ``critic/heldout_ev`` is the explained
variance ``1 - Var(R - V) / Var(R)`` of the same pairs (blind to a constant
offset), ``critic/heldout_auc`` how well V ranks successes (R > 0.5) above
failures.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

from sao.algo.stats import binary_auc, explained_variance_n
from sao.types import Batch, Trajectory, collate


class _Critic(Protocol):
    """What :func:`prompt_values` needs of a :class:`~sao.train.trainer.Trainer`."""

    @property
    def critic(self) -> object | None: ...

    @property
    def device(self) -> torch.device: ...

    def values(self, batch: Batch) -> torch.Tensor | None: ...


__all__ = [
    "CriticFit",
    "first_action_values",
    "heldout_fit",
    "heldout_fit_by_turn",
    "turn_start_values",
    "turn_values",
]


def first_action_values(
    values_BT: torch.Tensor, returns_BT: torch.Tensor, action_mask_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The value and the return at each row's first action token (``[B]`` each;
    rows without an action token are left out)."""
    has_B = action_mask_BT.any(dim=1)
    first_B = action_mask_BT.float().argmax(dim=1)  # first True (argmax takes the first max)
    rows = torch.arange(values_BT.shape[0], device=values_BT.device)[has_B]
    first = first_B[has_B]
    return values_BT[rows, first].detach().float(), returns_BT[rows, first].detach().float()


def turn_start_values(
    values_BT: torch.Tensor, returns_BT: torch.Tensor, turn_id_BT: torch.Tensor
) -> list[tuple[int, float, float]]:
    """(turn index from 0, value, return) at the first action token of each turn
    of each row (``turn_id_BT``: the turn index on action tokens, -1 elsewhere)."""
    v, r, t = (x.detach().float().cpu() for x in (values_BT, returns_BT, turn_id_BT))
    out = []
    for b in range(t.shape[0]):
        seen: set[int] = set()
        for pos in torch.nonzero(t[b] >= 0).flatten().tolist():
            k = int(t[b, pos])
            if k not in seen:
                seen.add(k)
                out.append((k, float(v[b, pos]), float(r[b, pos])))
    return out


class CriticFit:
    """A window of out-of-sample (value, return, running-mean) triples at the
    prompt, and one of (value, return) pairs at the start of each turn."""

    def __init__(self, window: int = 128) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        self.pairs: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.total = 0.0  # of every return recorded (the running mean's numerator)
        self.count = 0
        self.best = -math.inf  # the highest gain seen by plateaued(), and batches since
        self.since_best = 0
        self.by_turn: dict[int, deque[tuple[float, float]]] = {}

    def record(self, values_B: torch.Tensor, returns_B: torch.Tensor) -> None:
        """Add one batch's predictions (made before the critic trained on it)."""
        mean_before = self.total / self.count if self.count else math.nan
        for v, r in zip(values_B.tolist(), returns_B.tolist(), strict=True):
            if math.isfinite(v) and math.isfinite(r):
                self.pairs.append((v, r, mean_before))
                self.total += r
                self.count += 1

    def record_turns(self, items: Sequence[tuple[int, float, float]]) -> None:
        """Add one batch's (turn, value, return) at each turn's start (values from
        before the critic trained on the batch: :func:`turn_start_values`)."""
        for k, v, r in items:
            if math.isfinite(v) and math.isfinite(r):
                window = self.by_turn.setdefault(k, deque(maxlen=self.pairs.maxlen))
                window.append((v, r))

    @property
    def full(self) -> bool:
        """Whether the window holds ``window`` episodes."""
        return len(self.pairs) == self.pairs.maxlen

    def gain(self) -> float:
        """``1 - MSE(critic) / MSE(running mean)`` over the window (NaN until a
        running mean existed for two episodes, or when every return equals it)."""
        scored = [(v, r, m) for v, r, m in self.pairs if math.isfinite(m)]
        if len(scored) < 2:
            return math.nan
        err = sum((r - v) ** 2 for v, r, _ in scored)
        base = sum((r - m) ** 2 for _, r, m in scored)
        return 1.0 - err / base if base > 0 else math.nan

    def ready(self, threshold: float) -> bool:
        """The window is full and the gain is at least ``threshold``."""
        g = self.gain()
        return self.full and math.isfinite(g) and g >= threshold

    def plateaued(self, patience: int) -> bool:
        """Called once a batch: whether the gain has not risen above its best for
        ``patience`` batches in a row (batches before it is defined do not count)."""
        gain = self.gain()
        if not math.isfinite(gain):
            return False
        if gain > self.best:
            self.best, self.since_best = gain, 0
        else:
            self.since_best += 1
        return self.since_best >= patience

    def stats(self) -> dict[str, float]:
        """``critic/heldout_{gain,ev,auc}`` over the window (module docstring) and
        ``critic/heldout_{ev,auc}_turnK`` of the values at the start of turn K of
        the same (sampled) episodes; one that is undefined yet (no running mean,
        all returns equal, one outcome only) is left out, so a plot shows a gap."""
        fit = (
            _ev_auc([p[0] for p in self.pairs], [p[1] for p in self.pairs], "critic/heldout")
            if self.pairs
            else {}
        )
        for k, pairs in sorted(self.by_turn.items()):  # the sampled episodes, out of sample
            if len(pairs) >= 2:
                turn = _ev_auc([p[0] for p in pairs], [p[1] for p in pairs], "critic/heldout")
                fit |= {f"{key}_turn{k + 1}": x for key, x in turn.items()}
        gain = self.gain()
        return fit | ({"critic/heldout_gain": gain} if math.isfinite(gain) else {})

    def state_dict(self) -> dict[str, object]:
        """The window and the running mean, for checkpoints."""
        return {
            "pairs": list(self.pairs),
            "total": self.total,
            "count": self.count,
            "best": self.best,
            "since_best": self.since_best,
            "by_turn": {str(k): list(v) for k, v in self.by_turn.items()},
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.pairs.clear()
        self.pairs.extend(tuple(p) for p in state["pairs"])  # type: ignore[attr-defined]
        self.total = float(state["total"])  # type: ignore[arg-type]
        self.count = int(state["count"])  # type: ignore[call-overload]
        self.best = float(state.get("best", -math.inf))  # type: ignore[arg-type]
        self.since_best = int(state.get("since_best", 0))  # type: ignore[call-overload]
        by_turn = state.get("by_turn") or {}
        self.by_turn = {
            int(k): deque((tuple(p) for p in v), maxlen=self.pairs.maxlen)
            for k, v in by_turn.items()  # type: ignore[attr-defined]
        }


def turn_values(trainer: _Critic, trajectories: Sequence[Trajectory]) -> list[list[float]]:
    """The critic's value at the first action token of each turn of each
    trajectory (the state the turn starts from: the prompt and every earlier
    action and observation), in order; ``[]`` for a trajectory without an action
    token (a failed episode) and NaN for every turn when the trainer has no
    critic. One forward of the critic, no gradient (on every rank of a sharded
    critic: a collective)."""
    out = [[math.nan] * len(t.turns) if t.num_action_tokens else [] for t in trajectories]
    rows = [i for i, t in enumerate(trajectories) if t.num_action_tokens > 0]
    if trainer.critic is None or not rows:
        return out
    batch = collate([trajectories[i] for i in rows]).to(trainer.device)
    values_BT = trainer.values(batch)
    assert values_BT is not None
    values_BT = values_BT.detach().float().cpu()
    for b, i in enumerate(rows):
        out[i] = [float(values_BT[b, turn.start]) for turn in trajectories[i].turns]
    return out


def heldout_fit(values: Sequence[float], rewards: Sequence[float]) -> dict[str, float]:
    """``eval/critic_ev`` (explained variance) and ``eval/critic_auc`` (how well
    the values rank successes, reward > 0.5, above failures) of the critic's
    values at the prompts of held-out episodes against their rewards (pairs
    with a NaN value are left out). Held-out episodes are greedy while the
    critic learns the sampling policy's returns: the AUC, which ignores the
    scale, is the steadier of the two."""
    pairs = [(v, r) for v, r in zip(values, rewards, strict=True) if math.isfinite(v)]
    if len(pairs) < 2:
        return {}
    return _ev_auc([p[0] for p in pairs], [p[1] for p in pairs], "eval/critic")


def heldout_fit_by_turn(
    values: Sequence[Sequence[float]], rewards: Sequence[float]
) -> dict[str, float]:
    """Per-turn calibration: ``eval/critic_ev_turnK`` and ``eval/critic_auc_turnK``
    of the value at the start of turn K (1-based) against the episode's reward,
    over the held-out episodes that reached turn K (``values`` as
    :func:`turn_values` returns them). A critic that credits turns ranks
    episodes better at later turns, where what the earlier turns revealed is in
    its input; one that reads only the prompt stays at turn 1's figure."""
    out: dict[str, float] = {}
    for k in range(max((len(v) for v in values), default=0)):
        pairs = [
            (v[k], r)
            for v, r in zip(values, rewards, strict=True)
            if len(v) > k and math.isfinite(v[k])
        ]
        if len(pairs) >= 2:
            fit = _ev_auc([p[0] for p in pairs], [p[1] for p in pairs], "eval/critic")
            out |= {f"{key}_turn{k + 1}": x for key, x in fit.items()}
    return out


def _ev_auc(values: Sequence[float], returns: Sequence[float], prefix: str) -> dict[str, float]:
    """``PREFIX_ev`` and ``PREFIX_auc`` (successes: return > 0.5) of values against
    returns; one that is undefined (all returns equal, one outcome only) is left
    out, so a plot shows a gap."""
    v = torch.tensor(values, dtype=torch.float64, device="cpu")
    r = torch.tensor(returns, dtype=torch.float64, device="cpu")
    stats = {f"{prefix}_ev": explained_variance_n(v, r), f"{prefix}_auc": binary_auc(v, r > 0.5)}
    return {k: float(x) for k, x in stats.items() if math.isfinite(float(x))}
