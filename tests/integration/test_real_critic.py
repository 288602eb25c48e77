"""SAO's critic on a real checkpoint: SmolLM2-135M-Instruct's value model,
trained as a run trains it (K=2 updates a batch, frozen attention, critic LR
1e-4, the smollm2-arith-sao preset's task), predicts held-out returns better
than a constant baseline.

Greedy episodes make the data deterministic: each prompt's outcome is a fixed
function of the prompt, which the critic can only learn from other prompts
(sums are right more often than differences; a negative difference never is).
The critic is judged on questions it never saw, against the mean return of
its training episodes (the best constant it could have learned). Skipped
unless ``SAO_REAL_MODEL`` is set (``make test-real``).
"""

from __future__ import annotations

import asyncio
import math
import os
from pathlib import Path

import pytest
import torch

from sao.app.parts import build_task
from sao.config import Config, load_config
from sao.models.freeze import freeze_attention
from sao.models.loading import load_policy, load_tokenizer
from sao.models.value import ValueModel
from sao.rollout.agent import EpisodeLimits, run_episode
from sao.rollout.embedded.engine import TorchEngine
from sao.train.critic_fit import heldout_fit, turn_values
from sao.train.trainer import OptimSettings, Trainer
from sao.types import SamplingParams, Trajectory

REAL_MODEL = os.environ.get("SAO_REAL_MODEL", "")
pytestmark = [
    pytest.mark.real,
    pytest.mark.timeout(900),  # ~3 min alone on 2 cores; 7.5 min beside a training run
    pytest.mark.skipif(
        not REAL_MODEL, reason="set SAO_REAL_MODEL to the SmolLM2 directory (make test-real)"
    ),
]
TRAIN, HELD_OUT, BATCH, PASSES = 128, 100, 16, 2
MARGIN = 0.01
"""The held-out gain over the constant must exceed this. Measured (2-core x86_64, torch
2.13.0 CPU): gain 0.032 (MSE 0.1951 against the constant's 0.2016), explained variance
0.034, AUC 0.700. A small gain, as expected: on this task ~0.1-0.3 of the return's
variance is explainable at all (docs/critic.md); the ranking (AUC) is the clearer signal."""
AUC_FLOOR = 0.62
"""Measured 0.700 (the line above); 0.5 is chance."""


def greedy_episodes(split: str, n: int) -> tuple[list[Trajectory], Config]:
    cfg = load_config("smollm2-arith-sao", None, [f"model.path={REAL_MODEL}"])
    task = build_task(cfg)
    tok, policy = load_tokenizer(Path(REAL_MODEL)), load_policy(Path(REAL_MODEL))
    limits = EpisodeLimits(max_turns=1, max_total_tokens=320)
    sampling = SamplingParams(top_k=1, max_new_tokens=cfg.rollout.max_new_tokens)

    async def play() -> list[Trajectory]:
        engine = TorchEngine(policy, max_batch_size=32, max_seq_len=320, tokenizer=tok)
        try:
            return list(
                await asyncio.gather(
                    *(
                        run_episode(
                            task.make_env(split, i),  # type: ignore[arg-type]
                            engine,
                            tok,
                            sampling,
                            limits,
                            seed=i,
                            prompt_id=f"{split}/{i}",
                        )
                        for i in range(n)
                    )
                )
            )
        finally:
            await engine.aclose()

    return asyncio.run(play()), cfg


def test_the_critic_beats_a_constant_on_held_out_questions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    torch.manual_seed(0)
    train, cfg = greedy_episodes("train", TRAIN)
    held_out, _ = greedy_episodes("eval", HELD_OUT)
    critic = ValueModel.from_policy(Path(REAL_MODEL), seed=0)
    freeze_attention(critic)
    settings = OptimSettings(critic_lr=1e-4, critic_lr_warmup_steps=10)
    trainer = Trainer(None, critic, load_config("smollm2-arith-sao").algo.resolve(), settings)
    for _ in range(PASSES):  # as a run's critic-only warm-up steps train it
        for i in range(0, TRAIN, BATCH):
            trainer.step(train[i : i + BATCH], train_actor=False)

    rewards = [t.reward for t in held_out]
    mean = sum(t.reward for t in train) / len(train)  # the constant it could have learned
    values = [v[0] for v in turn_values(trainer, held_out)]
    mse = sum((r - v) ** 2 for v, r in zip(values, rewards, strict=True)) / len(rewards)
    const = sum((r - mean) ** 2 for r in rewards) / len(rewards)
    gain = 1 - mse / const
    fit = heldout_fit(values, rewards)
    with capsys.disabled():
        print(
            f"\n  critic on {HELD_OUT} held-out questions after {PASSES} passes over {TRAIN} "
            f"greedy episodes: gain over the constant {gain:.3f} (MSE {mse:.4f} vs {const:.4f}), "
            f"EV {fit.get('eval/critic_ev', math.nan):.3f}, "
            f"AUC {fit.get('eval/critic_auc', math.nan):.3f}; "
            f"train success {mean:.2f}, held-out {sum(rewards) / len(rewards):.2f}"
        )
    assert 0.1 < mean < 0.9 and 0 < sum(rewards) < len(rewards)  # both outcomes occur
    assert gain > MARGIN
    assert fit["eval/critic_auc"] > AUC_FLOOR
    assert cfg.algo.resolve().name == "sao"
