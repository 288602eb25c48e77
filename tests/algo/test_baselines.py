"""Hand-worked cases, properties and input errors for sao.algo.baselines."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sao.algo.baselines import (
    RunningMeanBaseline,
    broadcast_to_tokens,
    dynamic_sampling_mask,
    group_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
)

# Groups: 10 -> [1, 0, 1], 3 -> [0.5, 1.5], 42 -> [7] (singleton); ids not contiguous.
REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.5, 1.5, 7.0])
GROUPS = torch.tensor([10, 10, 10, 3, 3, 42])


def test_group_advantages_hand_case() -> None:
    # group 10: mean 2/3, unbiased var = ((1/3)^2 + (2/3)^2 + (1/3)^2) / 2 = 1/3, std = 0.57735
    #   A = (1/3) / 0.57735 = 0.57735, (-2/3) / 0.57735 = -1.15470
    # group 3: mean 1, unbiased var = (0.25 + 0.25) / 1 = 0.5, std = 0.70711 -> A = -/+ 0.70711
    # group 42: singleton -> 0
    s3 = 1 / math.sqrt(3)
    want = torch.tensor([s3, -2 * s3, s3, -math.sqrt(0.5), math.sqrt(0.5), 0.0])
    torch.testing.assert_close(group_advantages(REWARDS, GROUPS), want, atol=1e-5, rtol=1e-5)


def test_dr_grpo_hand_case() -> None:
    # no std division: R - mean_G = [1/3, -2/3, 1/3, -0.5, 0.5, 0]
    want = torch.tensor([1 / 3, -2 / 3, 1 / 3, -0.5, 0.5, 0.0])
    torch.testing.assert_close(group_advantages(REWARDS, GROUPS, normalize_std=False), want)


def test_group_advantages_constant_group_is_zero() -> None:
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]))
    assert torch.equal(adv, torch.zeros(3))


def test_rloo_hand_case() -> None:
    # group 10: 1 - (0 + 1)/2 = 0.5; 0 - (1 + 1)/2 = -1; 0.5
    # group 3: 0.5 - 1.5 = -1; 1.5 - 0.5 = 1; group 42 singleton -> 0
    want = torch.tensor([0.5, -1.0, 0.5, -1.0, 1.0, 0.0])
    torch.testing.assert_close(rloo_advantages(REWARDS, GROUPS), want)


def test_reinforce_pp_hand_case() -> None:
    # R = [1, 2, 3, 6]: mean 3, unbiased std = sqrt((4 + 1 + 0 + 9) / 3) = sqrt(14/3)
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0])
    want = torch.tensor([-2.0, -1.0, 0.0, 3.0]) / math.sqrt(14 / 3)
    torch.testing.assert_close(reinforce_pp_advantages(rewards), want, atol=1e-5, rtol=1e-5)
    # with groups [0, 0, 1, 1]: x = R - mean_G = [-0.5, 0.5, -1.5, 1.5], mean 0,
    # std = sqrt((0.25 + 0.25 + 2.25 + 2.25) / 3) = sqrt(5/3)
    adv = reinforce_pp_advantages(rewards, group_ids_B=torch.tensor([0, 0, 1, 1]))
    want = torch.tensor([-0.5, 0.5, -1.5, 1.5]) / math.sqrt(5 / 3)
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(reinforce_pp_advantages(torch.tensor([3.0])), torch.zeros(1))


def test_broadcast_to_tokens() -> None:
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]], dtype=torch.bool)
    # row 1 has no action token: its (NaN) advantage is never read
    out = broadcast_to_tokens(torch.tensor([2.0, float("nan")]), mask)
    assert out.tolist() == [[2.0, 0.0, 2.0], [0.0, 0.0, 0.0]]
    assert broadcast_to_tokens(torch.tensor([1.0, 1.0]).bfloat16(), mask).dtype == torch.bfloat16


def test_dynamic_sampling_mask() -> None:
    # group 0: [1, 1] all equal -> drop; group 1: [0, 1] -> keep; group 2: singleton -> drop
    keep = dynamic_sampling_mask(
        torch.tensor([1.0, 1.0, 0.0, 1.0, 5.0]), torch.tensor([0, 0, 1, 1, 2])
    )
    assert keep.tolist() == [False, False, True, True, False]
    assert dynamic_sampling_mask(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0


def test_overlong_penalty() -> None:
    # max_len 10, cache 4: soft limit 6. l=3 -> 0; 6 -> 0; 7 -> (6-7)/4 = -0.25;
    # 10 -> (6-10)/4 = -1; 11 -> -1 (beyond max_len)
    pen = overlong_penalty(torch.tensor([3, 6, 7, 10, 11]), max_len=10, cache_len=4)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.25, -1.0, -1.0]))


def test_running_mean_per_prompt() -> None:
    base = RunningMeanBaseline(window=2, per_prompt=True)
    # no history at all -> 0 [choice]
    assert base.advantages(torch.tensor([1.0, 0.0]), ["a", "b"]).tolist() == [0.0, 0.0]
    # a's window [1]: 3 - 1 = 2, 1 - 1 = 0 (rows of a batch don't see each other);
    # c is new -> the global window (size 2) [1, 0], mean 0.5: 5 - 0.5 = 4.5
    adv = base.advantages(torch.tensor([3.0, 1.0, 5.0]), ["a", "a", "c"])
    assert adv.tolist() == [2.0, 0.0, 4.5]
    # a's window (size 2) is now [3, 1]: 0 - 2 = -2; b's window [0]: 4 - 0 = 4
    assert base.advantages(torch.tensor([0.0, 4.0]), ["a", "b"]).tolist() == [-2.0, 4.0]
    # d is new; the global window is now [0, 4] (the last two rewards): 1 - 2 = -1
    assert base.advantages(torch.tensor([1.0]), ["d"]).tolist() == [-1.0]


def test_running_mean_global_and_state_round_trip() -> None:
    base = RunningMeanBaseline(window=3, per_prompt=False)
    assert base.advantages(torch.tensor([1.0, 2.0]), ["x", "y"]).tolist() == [0.0, 0.0]
    # window [1, 2] mean 1.5: 4 - 1.5 = 2.5, 0 - 1.5 = -1.5; then window [2, 4, 0]
    assert base.advantages(torch.tensor([4.0, 0.0]), ["x", "z"]).tolist() == [2.5, -1.5]
    restored = RunningMeanBaseline(window=3, per_prompt=False)
    restored.load_state_dict(json.loads(json.dumps(base.state_dict())))
    assert restored.state_dict() == base.state_dict()
    # window mean 2: 1 - 2 = -1, on both
    nxt = torch.tensor([1.0])
    assert restored.advantages(nxt, ["q"]).tolist() == base.advantages(nxt, ["q"]).tolist() == [-1]
    with pytest.raises(ValueError, match="per_prompt"):
        RunningMeanBaseline(window=3, per_prompt=True).load_state_dict(base.state_dict())


def test_running_mean_shorter_window_on_load() -> None:
    base = RunningMeanBaseline(window=4, per_prompt=True)
    base.advantages(torch.tensor([1.0, 2.0, 3.0]), ["a", "a", "a"])
    small = RunningMeanBaseline(window=2, per_prompt=True)
    small.load_state_dict(base.state_dict())
    assert small.state_dict()["history"] == {"a": [2.0, 3.0]}
    assert small.state_dict()["global"] == [2.0, 3.0]


@settings(max_examples=100, deadline=None)
@given(
    rewards=st.lists(st.floats(-5, 5, allow_nan=False), min_size=1, max_size=24),
    data=st.data(),
    normalize_std=st.booleans(),
)
def test_group_and_rloo_advantages_sum_to_zero_per_group(
    rewards: list[float], data: st.DataObject, normalize_std: bool
) -> None:
    n = len(rewards)
    groups = torch.tensor(data.draw(st.lists(st.integers(-3, 100), min_size=n, max_size=n)))
    r = torch.tensor(rewards, dtype=torch.float64)
    adv = group_advantages(r, groups, normalize_std=normalize_std)
    loo = rloo_advantages(r, groups)
    for g in groups.unique():
        members = groups == g
        assert abs(float(adv[members].sum())) < 1e-6 * max(1, int(members.sum()))
        assert abs(float(loo[members].sum())) < 1e-9 * max(1.0, float(r.abs().max()))
        if normalize_std and int(members.sum()) > 1 and float(r[members].std()) > 1e-3:
            torch.testing.assert_close(
                adv[members].std(), torch.tensor(1.0, dtype=torch.float64), atol=1e-3, rtol=1e-3
            )


def test_baselines_bf16_dtype() -> None:
    r = REWARDS.bfloat16()
    assert group_advantages(r, GROUPS).dtype == torch.bfloat16
    assert rloo_advantages(r, GROUPS).dtype == torch.bfloat16
    assert reinforce_pp_advantages(r).dtype == torch.bfloat16
    assert group_advantages(torch.tensor([1, 0]), torch.tensor([0, 0])).dtype == torch.float32


def test_baselines_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="group_ids_B"):
        group_advantages(REWARDS, GROUPS[:3])
    with pytest.raises(ValueError, match="group_ids_B"):
        rloo_advantages(REWARDS, GROUPS.float())
    with pytest.raises(ValueError, match="rewards_B"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="rewards_B"):
        reinforce_pp_advantages(torch.ones(2, 2))
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([3]), max_len=10, cache_len=0)
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([3]), max_len=10, cache_len=11)
    with pytest.raises(ValueError, match="advantages_B"):
        broadcast_to_tokens(torch.zeros(3), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="window"):
        RunningMeanBaseline(window=0, per_prompt=True)
    with pytest.raises(ValueError, match="prompt_ids"):
        RunningMeanBaseline(window=2, per_prompt=True).advantages(torch.zeros(2), ["a"])
