"""The actor's learning-rate warm-up (``train.actor_lr_warmup_steps``): linear
over applied updates, kept in the trainer's state across a resume."""

from __future__ import annotations

import random

import pytest

from sao.algo.presets import PRESETS
from sao.models.tiny import build_tiny_policy
from sao.models.value import ValueModel
from sao.train.trainer import OptimSettings, Trainer
from tests.train.test_presets_step import TOK
from tests.train.test_shared_values import episode


def _trainer(warmup: int) -> Trainer:
    policy = build_tiny_policy(TOK, size="0.1m", seed=0)
    critic = ValueModel.from_policy(policy, seed=1)
    settings = OptimSettings(actor_lr=1e-3, actor_lr_warmup_steps=warmup)
    return Trainer(policy, critic, PRESETS["sao"], settings)


def test_actor_rate_rises_linearly_over_the_warmup() -> None:
    rng = random.Random(0)
    trainer = _trainer(4)
    _, _, optim = trainer.actor_parts()
    seen = []
    for _ in range(6):
        seen.append(optim.param_groups[0]["lr"])  # the rate of the update about to run
        trainer.step([episode(rng, 2, f"g{i}") for i in range(4)])
    # updates 0..5 at 1/4, 2/4, 3/4, 4/4, 4/4, 4/4 of 1e-3
    assert seen == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    # a critic-only warm-up step does not advance the actor's warm-up
    fresh = _trainer(4)
    fresh.step([episode(rng, 2, "w")], train_actor=False)
    assert fresh.actor_parts()[2].param_groups[0]["lr"] == pytest.approx(2.5e-4)
    # resumed from the trainer's state: the schedule goes on where it was
    resumed = _trainer(4)
    state = _trainer(4)
    state.step([episode(rng, 2, "a")])
    state.step([episode(rng, 2, "b")])
    resumed.load_state_dict(state.state_dict())
    assert resumed.actor_parts()[2].param_groups[0]["lr"] == pytest.approx(7.5e-4)


def test_no_warmup_is_the_full_rate_at_once() -> None:
    assert _trainer(0).actor_parts()[2].param_groups[0]["lr"] == pytest.approx(1e-3)
