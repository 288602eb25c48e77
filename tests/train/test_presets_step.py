"""Every algorithm preset runs a trainer step, and its update moves the policy
towards the rewarded behaviour."""

from __future__ import annotations

import math

import pytest
import torch

from sao.algo.presets import PRESETS
from sao.models.logprobs import sequence_logprobs
from sao.models.lora import add_lora
from sao.models.tiny import build_tiny_policy
from sao.models.tokenization import build_char_tokenizer
from sao.models.value import ValueModel
from sao.train.trainer import OptimSettings, Trainer
from sao.types import Trajectory, Turn

TOK = build_char_tokenizer(alphabet="ab\n")
A, B = TOK.convert_tokens_to_ids("a"), TOK.convert_tokens_to_ids("b")
PROMPT = (2, 5, 3)


def two_turn(model: torch.nn.Module, x: int, reward: float, group: str) -> Trajectory:
    """[prompt] x x [obs: b] x x with the model's own log-probs as rollout log-probs."""
    tokens = (*PROMPT, x, x, B, x, x)
    mask = (False, False, False, True, True, False, True, True)
    with torch.no_grad():
        lp = sequence_logprobs(model, torch.tensor([tokens]), torch.ones(1, 8, dtype=torch.bool))
    logp = tuple(float(v) if m else 0.0 for v, m in zip(lp[0].tolist(), mask, strict=True))
    return Trajectory(
        prompt_id=group,
        tokens=tokens,
        action_mask=mask,
        rollout_logp=logp,
        versions=tuple(0 if m else -1 for m in mask),
        turns=(Turn(3, 5, 6), Turn(6, 8, 8)),
        reward=reward,
        finish_reason="stop",
        group_id=group,
    )


def logp_of(model: torch.nn.Module, x: int) -> float:
    tokens = torch.tensor([[*PROMPT, x, x, B, x, x]])
    with torch.no_grad():
        lp = sequence_logprobs(model, tokens, torch.ones_like(tokens, dtype=torch.bool))
    return float(lp[0, [3, 4, 6, 7]].sum())


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_step_prefers_rewarded_actions(name: str, lora: bool) -> None:
    algo = PRESETS[name].with_(group_size=2) if PRESETS[name].group_size > 1 else PRESETS[name]
    if algo.advantage == "running_mean":
        algo = algo.with_(running_mean_per_prompt=False)
    model = build_tiny_policy(TOK, size="0.1m", seed=0)
    critic = ValueModel.from_policy(model) if algo.use_critic else None
    lr = 1e-2  # (with a LoRA critic at 3e-2, step_last_token's values overshoot and flip)
    if lora:  # adapters on the actor and the critic (its attention left out when frozen)
        add_lora(model, rank=4, alpha=8.0)
        if critic is not None:
            skip = algo.freeze_critic_attention
            add_lora(critic.backbone, rank=4, alpha=8.0, skip_attention=skip, train_final_norm=True)
    trainer = Trainer(model, critic, algo, OptimSettings(actor_lr=lr, critic_lr=lr))
    before = logp_of(model, A) - logp_of(model, B)
    for step in range(4):
        # two groups of two: "a" is rewarded, "b" is not
        batch = [
            two_turn(model, A, 1.0, f"g{step}a"),
            two_turn(model, B, 0.0, f"g{step}a"),
            two_turn(model, A, 1.0, f"g{step}b"),
            two_turn(model, B, 0.0, f"g{step}b"),
        ]
        stats = trainer.step(batch)
        assert all(
            math.isfinite(float(v)) or k.endswith("explained_variance") for k, v in stats.items()
        )
        assert float(stats["time/critic_s"]) >= 0 and float(stats["time/actor_s"]) > 0
    after = logp_of(model, A) - logp_of(model, B)
    # the running-mean baseline has no history at its first step (advantage 0), then learns
    assert after > before + 0.5, (name, before, after)
