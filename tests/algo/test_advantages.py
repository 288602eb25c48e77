"""Hand-worked cases, edge cases and input errors for sao.algo.advantages.

Property tests (skip-observation GAE == plain GAE on the action-only sequence,
step-level == token GAE with one token per turn) live in test_adv_properties.py.
"""

from __future__ import annotations

import pytest
import torch

from sao.algo.advantages import (
    adaptive_lambda,
    count_turns,
    gae,
    length_adaptive_lambda,
    step_level_gae,
)

NAN = float("nan")


def _row(*xs: float) -> torch.Tensor:
    return torch.tensor([xs], dtype=torch.float32)


# Row [prompt, a, a, obs, a, pad]; NaN values off the action tokens must not leak.
MASK_1 = torch.tensor([[0, 1, 1, 0, 1, 0]], dtype=torch.bool)
REWARDS_1 = _row(0, 0, 0, 0, 1.0, 0)
VALUES_1 = _row(NAN, 1.0, 0.5, NAN, 0.5, NAN)


# --------------------------------------------------------------------------- gae


def test_gae_hand_case_skips_observation() -> None:
    # gamma = 1, lam = 0.5; action chain V = [1.0, 0.5, 0.5], r = [0, 0, 1]
    # delta(4) = 1 + 0 - 0.5 = 0.5               A(4) = 0.5
    # delta(2) = 0 + V(4) - V(2) = 0.5 - 0.5 = 0  A(2) = 0 + 0.5 * 0.5 = 0.25  (across the obs)
    # delta(1) = 0 + 0.5 - 1.0 = -0.5            A(1) = -0.5 + 0.5 * 0.25 = -0.375
    # returns = A + V = [0.625, 0.75, 1.0]
    adv, ret = gae(REWARDS_1, VALUES_1, MASK_1, gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, _row(0, -0.375, 0.25, 0, 0.5, 0))
    torch.testing.assert_close(ret, _row(0, 0.625, 0.75, 0, 1.0, 0))


def test_gae_truncated_bootstrap_and_zero() -> None:
    # Same row, cut by the length limit. bootstrap: V(after cut) := V(4) = 0.5
    # delta(4) = 1 + 0.5 - 0.5 = 1       A(4) = 1
    # delta(2) = 0                       A(2) = 0 + 0.5 * 1 = 0.5
    # delta(1) = -0.5                    A(1) = -0.5 + 0.5 * 0.5 = -0.25
    # returns = [0.75, 1.0, 1.5]; "zero" is the finished-episode answer.
    truncated = torch.tensor([True])
    adv, ret = gae(REWARDS_1, VALUES_1, MASK_1, lam=0.5, truncated_B=truncated)
    torch.testing.assert_close(adv, _row(0, -0.25, 0.5, 0, 1.0, 0))
    torch.testing.assert_close(ret, _row(0, 0.75, 1.0, 0, 1.5, 0))
    adv_zero, ret_zero = gae(
        REWARDS_1, VALUES_1, MASK_1, lam=0.5, truncated_B=truncated, truncation="zero"
    )
    torch.testing.assert_close(adv_zero, _row(0, -0.375, 0.25, 0, 0.5, 0))
    torch.testing.assert_close(ret_zero, _row(0, 0.625, 0.75, 0, 1.0, 0))


def test_gae_discount_hand_case() -> None:
    # gamma = 0.5, lam = 1, V = 0, r = [0, 0, 1]:
    # A(2) = 1, A(1) = 0.5 * 1 = 0.5, A(0) = 0.5 * 0.5 = 0.25 (= discounted return)
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae(_row(0, 0, 1), torch.zeros(1, 3), mask, gamma=0.5, lam=1.0)
    torch.testing.assert_close(adv, _row(0.25, 0.5, 1.0))
    torch.testing.assert_close(ret, _row(0.25, 0.5, 1.0))


def test_gae_per_row_lambda_and_trailing_observation() -> None:
    # Rows [a, a, obs] (a trailing observation after the last action), V = [1, 1], r = [0, 2].
    # delta = [0 + 1 - 1, 2 + 0 - 1] = [0, 1]
    # lam = 0: A = delta = [0, 1];   lam = 1: A = [0 + 1, 1] = [1, 1]
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0, 2.0, 0], [0, 2.0, 0]])
    values = torch.tensor([[1.0, 1.0, NAN], [1.0, 1.0, NAN]])
    adv, ret = gae(rewards, values, mask, lam=torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(adv, torch.tensor([[0, 1.0, 0], [1.0, 1.0, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 2.0, 0], [2.0, 2.0, 0]]))


def test_gae_row_without_actions_and_all_masked_batch() -> None:
    values = torch.tensor([[NAN, 0.3, 0.7], [1.0, 2.0, 3.0]])
    mask = torch.tensor([[0, 0, 0], [1, 0, 1]], dtype=torch.bool)
    rewards = torch.tensor([[0, 0, 0], [0, 0, 1.0]])
    adv, ret = gae(rewards, values, mask, lam=1.0)
    # row 1: A(2) = 1 - 3 = -2, A(0) = 0 + 3 - 1 + (-2) = 0; returns [1, 1]
    torch.testing.assert_close(adv, torch.tensor([[0, 0, 0], [0, 0, -2.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0, 0, 0], [1.0, 0, 1.0]]))
    none = torch.zeros(2, 3, dtype=torch.bool)
    adv, ret = gae(torch.zeros(2, 3), values, none, lam=0.9, truncated_B=torch.tensor([1, 0]))
    assert torch.equal(adv, torch.zeros(2, 3)) and torch.equal(ret, torch.zeros(2, 3))


def test_gae_single_position() -> None:
    # T = 1: A = r - V = 1 - 0.25
    adv, ret = gae(_row(1.0), _row(0.25), torch.ones(1, 1, dtype=torch.bool), lam=0.3)
    torch.testing.assert_close(adv, _row(0.75))
    torch.testing.assert_close(ret, _row(1.0))


def test_gae_bf16_inputs_computed_in_float32() -> None:
    adv, ret = gae(
        REWARDS_1.bfloat16(), VALUES_1.bfloat16(), MASK_1, lam=0.5, truncated_B=torch.tensor([0])
    )
    assert adv.dtype == torch.bfloat16 and ret.dtype == torch.bfloat16
    torch.testing.assert_close(adv.float(), _row(0, -0.375, 0.25, 0, 0.5, 0))
    # mixed: float32 rewards with bf16 values promote to float32
    adv32, _ = gae(REWARDS_1, VALUES_1.bfloat16(), MASK_1, lam=0.5)
    assert adv32.dtype == torch.float32


def test_gae_float64_and_integer_mask() -> None:
    adv, _ = gae(REWARDS_1.double(), VALUES_1.double(), MASK_1.long(), lam=0.5)
    assert adv.dtype == torch.float64
    torch.testing.assert_close(adv, _row(0, -0.375, 0.25, 0, 0.5, 0).double())


# --------------------------------------------------------------------------- lambda


def test_length_adaptive_lambda_hand_case() -> None:
    # l = [4, 0, 1, 2]. alpha = 0.5: 1 - 1/(0.5*4) = 0.5; l = 0 -> 0; 0.5*1 < 1 -> 0; 0.5*2 = 1 -> 0
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0]])
    torch.testing.assert_close(
        length_adaptive_lambda(mask, alpha=0.5), torch.tensor([0.5, 0.0, 0.0, 0.0])
    )
    # alpha = 1.5 (the paper): l = 2 -> 1 - 1/3
    torch.testing.assert_close(
        adaptive_lambda(torch.tensor([2, 100]), alpha=1.5),
        torch.tensor([2 / 3, 1 - 1 / 150]),
    )


# --------------------------------------------------------------------------- step level

# Row [prompt, a0, a0, obs, a1, a1, pad]: turn reward 0.5 on turn 0, outcome 1.0 on turn 1.
STEP_MASK = torch.tensor([[0, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)
STEP_TURN = torch.tensor([[-1, 0, 0, -1, 1, 1, -1]])
STEP_REWARDS = _row(0, 0, 0.5, 0, 0, 1.0, 0)
STEP_VALUES = _row(NAN, 0.2, 0.4, NAN, 0.6, 1.0, NAN)


def test_step_level_average_hand_case() -> None:
    # gamma = 1, lam = 0.5. R = [0.5, 1.0]; V = [mean(0.2, 0.4), mean(0.6, 1.0)] = [0.3, 0.8]
    # delta1 = 1.0 - 0.8 = 0.2              A1 = 0.2
    # delta0 = 0.5 + 0.8 - 0.3 = 1.0        A0 = 1.0 + 0.5 * 0.2 = 1.1
    # returns: [1.1 + 0.3, 0.2 + 0.8] = [1.4, 1.0]; critic on every action token
    adv, ret, critic = step_level_gae(
        STEP_REWARDS, STEP_VALUES, STEP_MASK, STEP_TURN, lam=0.5, turn_value="average"
    )
    torch.testing.assert_close(adv, _row(0, 1.1, 1.1, 0, 0.2, 0.2, 0))
    torch.testing.assert_close(ret, _row(0, 1.4, 1.4, 0, 1.0, 1.0, 0))
    assert torch.equal(critic, STEP_MASK)


def test_step_level_last_token_hand_case() -> None:
    # V = [V(pos 2), V(pos 5)] = [0.4, 1.0]
    # delta1 = 1.0 - 1.0 = 0                A1 = 0
    # delta0 = 0.5 + 1.0 - 0.4 = 1.1        A0 = 1.1 + 0.5 * 0 = 1.1
    # returns: [1.5, 1.0]; critic only on the last token of each turn
    adv, ret, critic = step_level_gae(
        STEP_REWARDS, STEP_VALUES, STEP_MASK, STEP_TURN, lam=0.5, turn_value="last_token"
    )
    torch.testing.assert_close(adv, _row(0, 1.1, 1.1, 0, 0.0, 0.0, 0))
    torch.testing.assert_close(ret, _row(0, 1.5, 1.5, 0, 1.0, 1.0, 0))
    assert critic.tolist() == [[False, False, True, False, False, True, False]]


def test_step_level_truncated_bootstraps_last_turn() -> None:
    # average, truncated: delta1 = 1.0 + 0.8 - 0.8 = 1.0, A1 = 1.0;
    # delta0 = 1.0, A0 = 1.0 + 0.5 * 1.0 = 1.5
    adv, _, _ = step_level_gae(
        STEP_REWARDS, STEP_VALUES, STEP_MASK, STEP_TURN, lam=0.5, truncated_B=torch.tensor([1])
    )
    torch.testing.assert_close(adv, _row(0, 1.5, 1.5, 0, 1.0, 1.0, 0))


def test_step_level_skips_empty_turn_ids_and_counts_turns() -> None:
    # turn 1 produced no action token: turns 0 and 2 are consecutive steps.
    turn = torch.tensor([[-1, 0, 0, -1, 2, 2, -1]])
    adv, _, _ = step_level_gae(STEP_REWARDS, STEP_VALUES, STEP_MASK, turn, lam=0.5)
    torch.testing.assert_close(adv, _row(0, 1.1, 1.1, 0, 0.2, 0.2, 0))
    assert count_turns(turn, STEP_MASK).tolist() == [2]
    no_action = torch.zeros(2, 3, dtype=torch.bool)
    assert count_turns(torch.full((2, 3), -1), no_action).tolist() == [0, 0]


def test_step_level_no_actions_and_bf16() -> None:
    mask = torch.zeros(2, 4, dtype=torch.bool)
    adv, ret, critic = step_level_gae(
        torch.zeros(2, 4), torch.full((2, 4), NAN), mask, torch.full((2, 4), -1), lam=1.0
    )
    assert torch.equal(adv, torch.zeros(2, 4)) and torch.equal(ret, torch.zeros(2, 4))
    assert not bool(critic.any())
    adv, _, _ = step_level_gae(
        STEP_REWARDS.bfloat16(), STEP_VALUES.bfloat16(), STEP_MASK, STEP_TURN, lam=0.5
    )
    assert adv.dtype == torch.bfloat16
    torch.testing.assert_close(adv.float(), _row(0, 1.1, 1.1, 0, 0.2, 0.2, 0), atol=1e-2, rtol=0)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lam": 1.5}, "lam"),
        ({"lam": -0.1}, "lam"),
        ({"lam": NAN}, "lam"),
        ({"lam": torch.tensor([0.5, 2.0])}, "lam"),
        ({"lam": torch.tensor([0.5, 0.5, 0.5])}, "lam"),
        ({"lam": 0.5, "gamma": 1.01}, "gamma"),
        ({"lam": 0.5, "gamma": -1.0}, "gamma"),
        ({"lam": 0.5, "truncation": "drop"}, "truncation"),
        ({"lam": 0.5, "truncated_B": torch.tensor([True])}, "truncated_B"),
        ({"lam": 0.5, "truncated_B": torch.tensor([0, 2])}, "truncated_B"),
    ],
)
def test_gae_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=match):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), mask, **kwargs)


def test_gae_rejects_bad_tensors() -> None:
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    zeros = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="values_BT"):
        gae(zeros, torch.zeros(1, 4), mask, lam=0.5)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        gae(torch.zeros(3), torch.zeros(3), mask[0], lam=0.5)
    with pytest.raises(ValueError, match="values_BT contains 1 NaN"):
        gae(zeros, _row(0, NAN, NAN), mask, lam=0.5)  # the NaN at position 2 is ignored
    with pytest.raises(ValueError, match="rewards_BT contains"):
        gae(_row(float("inf"), 0, 0), zeros, mask, lam=0.5)
    with pytest.raises(ValueError, match="outside action_mask_BT"):
        gae(_row(0, 0, 1.0), zeros, mask, lam=0.5)
    with pytest.raises(ValueError, match="action_mask_BT"):
        gae(zeros, zeros, torch.tensor([[0, 2, 1]]), lam=0.5)


def test_lambda_rejects_bad_alpha_and_lengths() -> None:
    with pytest.raises(ValueError, match="alpha"):
        length_adaptive_lambda(torch.ones(1, 3, dtype=torch.bool), alpha=0.0)
    with pytest.raises(ValueError, match="alpha"):
        adaptive_lambda(torch.tensor([3]), alpha=-1.0)
    with pytest.raises(ValueError, match="lengths_B"):
        adaptive_lambda(torch.tensor([-1]), alpha=1.0)


def test_step_level_rejects_bad_turns() -> None:
    args = (STEP_REWARDS, STEP_VALUES, STEP_MASK)
    with pytest.raises(ValueError, match="turn_value"):
        step_level_gae(*args, STEP_TURN, lam=0.5, turn_value="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="turn_id_BT"):
        step_level_gae(*args, torch.tensor([[-1, 0, -1, -1, 1, 1, -1]]), lam=0.5)
    with pytest.raises(ValueError, match="non-decreasing"):
        step_level_gae(*args, torch.tensor([[-1, 1, 1, -1, 0, 0, -1]]), lam=0.5)
    with pytest.raises(ValueError, match="integer"):
        step_level_gae(*args, STEP_TURN.float(), lam=0.5)
    with pytest.raises(ValueError, match="turn_id_BT"):
        step_level_gae(*args, STEP_TURN[:, :5], lam=0.5)
    with pytest.raises(ValueError, match="gamma"):
        step_level_gae(*args, STEP_TURN, lam=0.5, gamma=2.0)


def test_gae_outputs_are_detached_targets() -> None:
    values = torch.tensor([[0.0, 1.0, 0.5, 0.0, 0.5, 0.0]], requires_grad=True)
    adv, ret = gae(REWARDS_1, values, MASK_1, lam=0.5)
    assert not adv.requires_grad and not ret.requires_grad
    adv, ret, _ = step_level_gae(
        STEP_REWARDS, torch.zeros(1, 7, requires_grad=True), STEP_MASK, STEP_TURN, lam=1.0
    )
    assert not adv.requires_grad
