"""End to end: the whole pipeline (engine, agent loop, buffer, trainer,
weight publishing) measurably raises reward on a tiny task, for SAO and GRPO."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sao.config import load_config
from sao.envs.base import Conversation, Split
from sao.runtime.run import train
from sao.types import Env, Message, StepResult


class SayAEnv:
    """Reply with as many 'a' as you can: reward = share of 'a' in the first 4 characters."""

    def __init__(self) -> None:
        self.reply = ""

    async def reset(self, seed: int) -> str:
        return "a"

    async def step(self, action: str) -> StepResult:
        self.reply = action
        return StepResult(done=True)

    def score(self) -> float:
        return self.reply[:4].count("a") / 4


class SayATask:
    """A task whose every problem is the same single-turn prompt."""

    name = "say_a"
    eval_size = 8

    def make_env(self, split: Split, index: int) -> Env:
        return SayAEnv()

    def demonstrations(self, n: int, *, seed: int) -> list[Conversation]:
        return [(Message("user", "a"), Message("assistant", "aaaa"))] * n


def run(tmp_path: Path, policy: Path, *overrides: str) -> list[dict[str, float]]:
    cfg = load_config(
        overrides=[
            f"model.path={policy}",
            f"log.run_dir={tmp_path / 'run'}",
            "log.live=false",
            "log.tensorboard=false",
            "log.plots=false",
            "train.steps=16",
            "train.batch_size=16",
            "train.actor_lr=3e-3",
            "train.critic_lr=3e-3",
            "rollout.in_flight=16",
            "rollout.max_new_tokens=4",
            "rollout.max_turns=1",
            "rollout.max_total_tokens=64",
            "eval.every=100",
            "eval.episodes=8",
            "log.checkpoint_every=100",
            *overrides,
        ]
    )
    run_dir = train(cfg, task=SayATask())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def _reward_gain(history: list[dict[str, float]]) -> tuple[float, float]:
    rewards = [r["train/reward_mean"] for r in history if "train/reward_mean" in r]
    return sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3


@pytest.mark.slow
def test_sao_raises_reward(tmp_path: Path, tiny_policy: Path) -> None:
    history = run(tmp_path, tiny_policy, "algo=sao", "algo.critic_pretrain_steps=2")
    first, last = _reward_gain(history)
    assert last > first + 0.2, (first, last)
    assert all("dis/masked_frac" in r for r in history[3:])
    assert any("critic/explained_variance" in r for r in history)


@pytest.mark.slow
def test_grpo_raises_reward(tmp_path: Path, tiny_policy: Path) -> None:
    history = run(tmp_path, tiny_policy, "algo=grpo", "algo.group_size=4")
    first, last = _reward_gain(history)
    assert last > first + 0.2, (first, last)
