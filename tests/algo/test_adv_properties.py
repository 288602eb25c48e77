"""Property tests for sao.algo.advantages against a tiny reference GAE."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sao.algo.advantages import gae, step_level_gae

NAN = float("nan")
finite = st.floats(-10, 10, allow_nan=False, allow_infinity=False, width=32)
unit = st.floats(0, 1, allow_nan=False)


def reference_gae(
    rewards: list[float],
    values: list[float],
    gamma: float,
    lam: float,
    bootstrap: bool,
) -> tuple[list[float], list[float]]:
    """Plain GAE (Schulman et al. 2016) on one sequence, in Python floats."""
    n = len(rewards)
    adv = [0.0] * n
    next_values = [*values[1:], values[-1] if bootstrap and n else 0.0]
    running = 0.0
    for k in reversed(range(n)):
        delta = rewards[k] + gamma * next_values[k] - values[k]
        running = delta + gamma * lam * running
        adv[k] = running
    return adv, [a + v for a, v in zip(adv, values, strict=True)]


@dataclass
class Case:
    rewards: torch.Tensor  # [B, T], 0 off the action tokens
    values: torch.Tensor  # [B, T], NaN off the action tokens
    mask: torch.Tensor  # [B, T] bool
    truncated: torch.Tensor  # [B] bool
    gamma: float
    lam: float | torch.Tensor


@st.composite
def cases(draw: st.DrawFn) -> Case:
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 12))
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))).view(B, T)
    rewards = torch.tensor(draw(st.lists(finite, min_size=B * T, max_size=B * T))).view(B, T)
    values = torch.tensor(draw(st.lists(finite, min_size=B * T, max_size=B * T))).view(B, T)
    truncated = torch.tensor(draw(st.lists(st.booleans(), min_size=B, max_size=B)))
    lam: float | torch.Tensor = draw(
        st.one_of(unit, st.lists(unit, min_size=B, max_size=B).map(torch.tensor))
    )
    return Case(
        rewards=torch.where(mask, rewards, 0.0).double(),
        values=torch.where(mask, values, NAN).double(),
        mask=mask,
        truncated=truncated,
        gamma=draw(unit),
        lam=lam,
    )


def _lam_of_row(lam: float | torch.Tensor, b: int) -> float:
    return float(lam[b]) if isinstance(lam, torch.Tensor) else float(lam)


@settings(max_examples=200, deadline=None)
@given(case=cases(), truncation=st.sampled_from(["bootstrap", "zero"]))
def test_gae_equals_plain_gae_on_action_only_sequence(case: Case, truncation: str) -> None:
    adv, ret = gae(
        case.rewards,
        case.values,
        case.mask,
        gamma=case.gamma,
        lam=case.lam,
        truncated_B=case.truncated,
        truncation=truncation,  # type: ignore[arg-type]
    )
    assert bool(torch.isfinite(adv).all()) and bool(torch.isfinite(ret).all())
    assert not bool(adv[~case.mask].any()) and not bool(ret[~case.mask].any())
    for b in range(case.mask.shape[0]):
        keep = case.mask[b]
        want_adv, want_ret = reference_gae(
            case.rewards[b, keep].tolist(),
            case.values[b, keep].tolist(),
            case.gamma,
            _lam_of_row(case.lam, b),
            bool(case.truncated[b]) and truncation == "bootstrap",
        )
        torch.testing.assert_close(adv[b, keep], torch.tensor(want_adv, dtype=torch.float64))
        torch.testing.assert_close(ret[b, keep], torch.tensor(want_ret, dtype=torch.float64))


@settings(max_examples=100, deadline=None)
@given(case=cases())
def test_monte_carlo_returns_with_lam_one(case: Case) -> None:
    # lam = 1, gamma = 1, no truncation: return(t) = sum of rewards at positions >= t.
    _, ret = gae(case.rewards, case.values, case.mask, gamma=1.0, lam=1.0)
    future = case.rewards.flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(ret, torch.where(case.mask, future, 0.0))


@settings(max_examples=100, deadline=None)
@given(
    case=cases(),
    turn_value=st.sampled_from(["average", "last_token"]),
    truncation=st.sampled_from(["bootstrap", "zero"]),
)
def test_step_level_with_one_token_per_turn_equals_token_gae(
    case: Case, turn_value: str, truncation: str
) -> None:
    turn_id = torch.where(case.mask, case.mask.long().cumsum(1) - 1, -1)
    kwargs = {
        "gamma": case.gamma,
        "lam": case.lam,
        "truncated_B": case.truncated,
        "truncation": truncation,
    }
    adv, ret, critic = step_level_gae(
        case.rewards,
        case.values,
        case.mask,
        turn_id,
        turn_value=turn_value,  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )
    want_adv, want_ret = gae(case.rewards, case.values, case.mask, **kwargs)  # type: ignore[arg-type]
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret, want_ret)
    assert torch.equal(critic, case.mask)


@settings(max_examples=100, deadline=None)
@given(case=cases(), seg=st.integers(1, 4))
def test_step_average_equals_gae_on_turn_sums(case: Case, seg: int) -> None:
    # Turns of `seg` consecutive action tokens: step-average GAE is plain GAE on the
    # per-turn reward sums and mean values, broadcast back to the tokens.
    turn_id = torch.where(case.mask, (case.mask.long().cumsum(1) - 1) // seg, -1)
    adv, _, _ = step_level_gae(
        case.rewards, case.values, case.mask, turn_id, gamma=case.gamma, lam=case.lam
    )
    for b in range(case.mask.shape[0]):
        ids = turn_id[b][case.mask[b]]
        n_turns = int(ids.max()) + 1 if ids.numel() else 0
        r = [float(case.rewards[b][turn_id[b] == i].sum()) for i in range(n_turns)]
        v = [float(case.values[b][turn_id[b] == i].mean()) for i in range(n_turns)]
        want, _ = reference_gae(r, v, case.gamma, _lam_of_row(case.lam, b), False)
        got = [float(adv[b][turn_id[b] == i][0]) for i in range(n_turns)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
