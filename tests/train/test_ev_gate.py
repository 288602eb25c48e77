"""EVPO's gate (``algo.ev_gate``): the critic's advantages when its explained
variance over the batch is above 0, else the batch mean's; worked by hand."""

from __future__ import annotations

import pytest
import torch

from sao.algo.presets import PRESETS
from sao.train.estimators import compute_targets
from sao.types import Trajectory, Turn, collate

SAO_MC = PRESETS["sao"].with_(lam_actor=1.0)  # actor advantages R - V(s_t): easy to check


def _batch(rewards: list[float]):
    """One prompt token, then two action tokens per episode."""
    trajs = [
        Trajectory(
            prompt_id=f"p{i}",
            tokens=(1, 2, 3),
            action_mask=(False, True, True),
            rollout_logp=(0.0, -1.0, -1.0),
            versions=(-1, 0, 0),
            turns=(Turn(1, 3, 3),),
            reward=r,
            finish_reason="stop",
        )
        for i, r in enumerate(rewards)
    ]
    return collate(trajs)


def _values(per_row: list[float]) -> torch.Tensor:
    return torch.tensor([[0.0, v, v] for v in per_row])


def test_a_critic_that_explains_the_batch_gives_the_advantages() -> None:
    # R 1, 1, 0, 0; V 0.9, 0.9, 0.1, 0.1: R - V = +-0.1, Var 0.01 < Var(R) 0.25 (EV 0.96)
    batch = _batch([1.0, 1.0, 0.0, 0.0])
    t = compute_targets(SAO_MC.with_(ev_gate=True), batch, _values([0.9, 0.9, 0.1, 0.1]), None)
    assert t.critic_baseline is True
    assert t.advantages_BT[:, 1:].flatten().tolist() == pytest.approx([0.1] * 4 + [-0.1] * 4)
    assert t.advantages_BT[:, 0].tolist() == [0.0] * 4  # the prompt token gets none


def test_a_critic_worse_than_the_mean_is_replaced_by_the_batch_mean() -> None:
    # V 0.1, 0.1, 0.9, 0.9: R - V = +-0.9, Var 0.81 > 0.25 (EV 1 - 0.81/0.25 = -2.24):
    # the batch mean 0.5 instead, R - 0.5 = +-0.5 on every action token
    batch = _batch([1.0, 1.0, 0.0, 0.0])
    values = _values([0.1, 0.1, 0.9, 0.9])
    t = compute_targets(SAO_MC.with_(ev_gate=True), batch, values, None)
    assert t.critic_baseline is False
    assert t.advantages_BT[:, 1:].flatten().tolist() == pytest.approx([0.5] * 4 + [-0.5] * 4)
    # the critic still trains on its Monte-Carlo targets
    assert t.returns_BT is not None and t.returns_BT[:, 1:].flatten().tolist() == pytest.approx(
        [1.0] * 4 + [0.0] * 4
    )
    # without the gate (paper) the critic's advantages: R - V = +-0.9
    paper = compute_targets(SAO_MC, batch, values, None)
    assert paper.critic_baseline is None
    assert paper.advantages_BT[0, 1:].tolist() == pytest.approx([0.9, 0.9])


def test_equal_returns_take_the_batch_mean_whose_advantages_are_zero() -> None:
    batch = _batch([1.0, 1.0, 1.0])  # Var(R) = 0: EV undefined, the critic's R - V is noise
    t = compute_targets(SAO_MC.with_(ev_gate=True), batch, _values([0.2, 0.5, 0.7]), None)
    assert t.critic_baseline is False and t.advantages_BT.abs().max().item() == 0.0
