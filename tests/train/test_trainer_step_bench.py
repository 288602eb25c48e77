"""Smoke test of benchmarks/trainer_step.py: its pass timing sees every pass
of an SAO step (and no values forward of its own), and leaves the trainer as
it found it. No timing is asserted."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch

from sao.train.trainer import OptimSettings

BENCH = Path(__file__).parents[2] / "benchmarks" / "trainer_step.py"


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trainer_step", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pass_timing_sees_each_pass_and_restores_the_trainer() -> None:
    ts = bench()
    policy = ts.build_policy("tiny")
    trajs = ts.make_batch("calc", 8, policy.config.vocab_size)
    sao, grpo, critic = ts.trainers(policy, OptimSettings(token_budget=256))
    wall, sys, faults, timed = ts.timed_step(sao, trajs)
    passes = timed.t
    assert wall > 0 and sys >= 0 and faults >= 0 and set(timed.faults) == set(passes)
    for k in ("critic update 1 forward", "critic update 2 backward", "actor backward"):
        assert k in passes, k
    assert not any(k.startswith("values fwd") for k in passes)  # shared with update 1
    assert "_apply" not in vars(sao) and "update_critic" not in vars(sao)
    assert "forward" not in vars(sao.critic) and torch.Tensor.backward.__name__ == "backward"
    passes = ts.timed_step(grpo, trajs)[3].t
    assert "actor forward (old policy)" not in passes  # PPO's old policy is the update's forward
    lengths = [len(t.tokens) for t in trajs]
    work = ts.work(policy, critic, lengths, sao.algo.critic_steps)
    assert work["sao"] > 2 * work["grpo"] > 0
