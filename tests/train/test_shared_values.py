"""The values for GAE come from the first critic update's forward
(``Trainer.first_critic_update``): the same numbers as a separate values
forward, so a step trains exactly as the step that ran one (bitwise: the
same micro-batches through the same kernels, with or without autograd, and
GAE is row-local, so a micro-batch's returns equal the whole batch's)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from sao.algo.presets import PRESETS, AlgoPreset
from sao.models.tiny import build_tiny_policy
from sao.models.value import ValueModel
from sao.train.estimators import Stats
from sao.train.trainer import OptimSettings, Trainer, to_cpu
from sao.types import Trajectory, Turn
from tests.train.test_presets_step import TOK


def episode(rng: random.Random, turns: int, group: str) -> Trajectory:
    """[prompt] then ``turns`` x ([actions][observation]), random tokens and log-probs."""
    mask = [False] * rng.randint(2, 5)
    spans = []
    for k in range(turns):
        start = len(mask)
        mask += [True] * rng.randint(1, 4)
        end = len(mask)
        if k < turns - 1:
            mask += [False] * rng.randint(1, 3)
        spans.append(Turn(start, end, len(mask)))
    return Trajectory(
        prompt_id=group,
        tokens=tuple(rng.randrange(1, len(TOK)) for _ in mask),
        action_mask=tuple(mask),
        rollout_logp=tuple(-rng.uniform(0.5, 2.0) if m else 0.0 for m in mask),
        versions=tuple(0 if m else -1 for m in mask),
        turns=tuple(spans),
        reward=float(rng.random() < 0.5),
        finish_reason="stop",
        group_id=group,
    )


def separate_values_step(trainer: Trainer, trajs: list[Trajectory]) -> Stats:
    """The step as it ran before: a values forward, then K critic updates, then the actor."""
    trainer.bad.begin_step()
    batch = trainer.prepare(trajs)
    values_BT = trainer.values(batch)
    targets = trainer.targets(batch, values_BT, trainer.running_mean)
    assert targets is not None
    stats = trainer.update_critic(batch, targets, values_BT)
    if trainer.algo.advantages_after_critic_update:
        targets = trainer.targets(batch, trainer.values(batch), None, before_update=False)
        assert targets is not None
    stats |= trainer.update_actor(batch, targets.advantages_BT)
    trainer.bad.end_step()
    return to_cpu(stats | trainer.batch_stats(batch, targets))


ALGOS = {
    "sao": PRESETS["sao"],
    "sao_value_clip": PRESETS["sao"].with_(value_clip=0.2),
    "sao_after_update": PRESETS["sao"].with_(advantages_after_critic_update=True),
    "step_last_token": PRESETS["step_last_token"],
    "vapo": PRESETS["vapo"],
}


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("name", sorted(ALGOS))
def test_shared_values_forward_trains_exactly_as_a_separate_one(name: str, packing: bool) -> None:
    algo: AlgoPreset = ALGOS[name]
    rng = random.Random(0)
    policy = build_tiny_policy(TOK, size="0.1m", seed=0)
    critic = ValueModel.from_policy(policy, seed=1)
    # a small token budget: several micro-batches of unequal lengths
    settings = OptimSettings(
        actor_lr=1e-2, critic_lr=1e-2, critic_lr_warmup_steps=1, token_budget=40, packing=packing
    )
    shared = Trainer(copy.deepcopy(policy), copy.deepcopy(critic), algo, settings)
    separate = Trainer(copy.deepcopy(policy), copy.deepcopy(critic), algo, settings)
    for step in range(3):
        trajs = [episode(rng, rng.randint(1, 4), f"g{step}.{i // 2}") for i in range(8)]
        got = shared.step(trajs)
        want = separate_values_step(separate, trajs)
        assert set(got) == set(want) | {"time/critic_s", "time/actor_s"}
        for k, v in want.items():  # (seconds differ)
            assert torch.equal(got[k], v) or (v.isnan() and got[k].isnan()), k
    for a, b in [(shared.policy, separate.policy), (shared.critic, separate.critic)]:
        assert a is not None and b is not None
        for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert torch.equal(p, q), n


def test_first_critic_update_values_equal_a_values_forward() -> None:
    rng = random.Random(1)
    policy = build_tiny_policy(TOK, size="0.1m", seed=0)
    critic = ValueModel.from_policy(policy, seed=1)
    trainer = Trainer(policy, critic, PRESETS["sao"], OptimSettings(token_budget=40))
    batch = trainer.prepare([episode(rng, rng.randint(1, 4), "") for _ in range(6)])
    want = trainer.values(batch)
    got, _ = trainer.first_critic_update(batch)
    assert want is not None and torch.equal(got, want)


@pytest.mark.parametrize("packing", [False, True])
def test_the_actor_forward_is_its_own_old_policy(packing: bool) -> None:
    """PPO's old log-probs (the pre-update policy) are the update's own forward,
    detached: bitwise what a separate no-gradient forward gives."""
    rng = random.Random(2)
    policy = build_tiny_policy(TOK, size="0.1m", seed=0)
    trainer = Trainer(
        policy, None, PRESETS["grpo"], OptimSettings(token_budget=40, packing=packing)
    )
    batch = trainer.prepare([episode(rng, rng.randint(1, 4), f"g{i // 2}") for i in range(6)])
    actor = trainer.actor_parts()[0]
    for mb, _ in trainer.ranks.micro_batches(batch, 40, packed=packing):
        with torch.no_grad():
            want = actor(mb.tokens_BT, mb.attention_mask_BT)
        assert torch.equal(actor(mb.tokens_BT, mb.attention_mask_BT).detach(), want)
