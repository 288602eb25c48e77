"""The critic on ranks of its own (sao/train/groups.py): a step split into the
critic's targets, then the critic's K updates and the actor's update, leaves
the same weights and metrics as the colocated ``Trainer.step``."""

from __future__ import annotations

import copy

import pytest
import torch

from sao.algo.presets import PRESETS
from sao.models.tiny import build_tiny_policy
from sao.models.value import ValueModel
from sao.train.groups import actor_update, critic_targets, critic_update, merge_stats
from sao.train.trainer import OptimSettings, Trainer
from tests.train.test_presets_step import TOK, A, B, two_turn

SETTINGS = OptimSettings(actor_lr=1e-2, critic_lr=1e-2, critic_lr_warmup_steps=1)


def _split_step(critic_t: Trainer, actor_t: Trainer, batch: list, train_actor: bool) -> dict:
    adv, pending = critic_targets(critic_t, batch, train_actor=train_actor)
    actor = None
    if train_actor and adv is not None:
        actor = {k: float(v) for k, v in actor_update(actor_t, batch, adv).items()}
    critic = {k: float(v) for k, v in critic_update(critic_t, pending).items()}
    return merge_stats(critic, actor)


@pytest.mark.parametrize("after_update", [False, True])
@pytest.mark.parametrize("name", ["sao", "ppo", "vapo"])
def test_split_groups_train_like_the_colocated_step(name: str, after_update: bool) -> None:
    algo = PRESETS[name].with_(advantages_after_critic_update=after_update)
    policy = build_tiny_policy(TOK, size="0.1m", seed=0)
    critic = ValueModel.from_policy(policy, seed=1)
    together = Trainer(copy.deepcopy(policy), copy.deepcopy(critic), algo, SETTINGS)
    actor_t = Trainer(copy.deepcopy(policy), None, algo, SETTINGS)
    critic_t = Trainer(None, copy.deepcopy(critic), algo, SETTINGS)
    for step, train_actor in enumerate([False, True, True]):  # a warm-up step, then two
        batch = [
            two_turn(policy, A, 1.0, f"g{step}"),
            two_turn(policy, B, 0.0, f"g{step}"),
            two_turn(policy, A, 0.5, f"h{step}"),
        ]
        want = {k: float(v) for k, v in together.step(batch, train_actor=train_actor).items()}
        got = _split_step(critic_t, actor_t, batch, train_actor)
        assert set(got) == set(want)
        for k, v in want.items():
            if not k.startswith("time/"):  # (seconds differ)
                assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    for a, b in [(together.policy, actor_t.policy), (together.critic, critic_t.critic)]:
        assert a is not None and b is not None
        for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=n)
    assert actor_t.critic is None and critic_t.policy is None


def test_a_trainer_without_a_policy_says_so() -> None:
    policy = build_tiny_policy(TOK, size="0.1m", seed=0)
    critic_t = Trainer(None, ValueModel.from_policy(policy), PRESETS["sao"], SETTINGS)
    with pytest.raises(RuntimeError, match="holds no policy"):
        critic_t.actor_parts()


def test_merge_stats_keeps_each_models_counts() -> None:
    critic = {
        "train/skipped_steps": 2.0,
        "train/consecutive_bad_steps": 1.0,
        "critic/skipped_steps": 2.0,
        "actor/skipped_steps": 0.0,
        "train/reward_mean": 0.5,
    }
    actor = {
        "train/skipped_steps": 1.0,
        "train/consecutive_bad_steps": 0.0,
        "critic/skipped_steps": 0.0,
        "actor/skipped_steps": 1.0,
        "actor/loss": -0.25,
        "train/reward_mean": 0.5,
    }
    assert merge_stats(critic, actor) == {
        "train/skipped_steps": 3.0,  # 2 + 1
        "train/consecutive_bad_steps": 1.0,  # the longer run
        "critic/skipped_steps": 2.0,
        "actor/skipped_steps": 1.0,
        "actor/loss": -0.25,
        "train/reward_mean": 0.5,
    }
    assert merge_stats(critic, None) == critic
