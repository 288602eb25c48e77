"""Padding-free (packed) forwards equal the padded ones: per-token log-probs,
critic values, and a whole trainer step (loss, gradients, updated weights)."""

from __future__ import annotations

import pytest
import torch

from sao.algo.presets import PRESETS
from sao.models.logprobs import sequence_logprobs
from sao.models.packing import pack_rows
from sao.models.tiny import build_tiny_policy
from sao.models.tokenization import build_char_tokenizer
from sao.models.value import ValueModel
from sao.train.split import packed_micro_batch_rows, padding_waste, worth_packing
from sao.train.trainer import OptimSettings, Trainer
from sao.types import Trajectory, Turn

TOK = build_char_tokenizer()
LENGTHS = (40, 33, 1, 5, 1, 2, 3, 7, 4, 1, 6, 2)  # long-tailed; three single-token rows


def long_tailed_batch(
    vocab: int, left: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens ``[B, T]``, attention mask and action mask (second half of each row)."""
    g = torch.Generator().manual_seed(seed)
    T = max(LENGTHS)
    tokens = torch.randint(1, vocab, (len(LENGTHS), T), generator=g)
    mask = torch.zeros(len(LENGTHS), T, dtype=torch.bool)
    action = torch.zeros_like(mask)
    for b, n in enumerate(LENGTHS):
        cols = slice(T - n, T) if left else slice(0, n)
        mask[b, cols] = True
        idx = mask[b].nonzero().squeeze(-1)
        action[b, idx[n // 2 :]] = True
    return tokens * mask, mask, action


def test_pack_rows_restarts_positions_per_row() -> None:
    tokens = torch.tensor([[7, 8, 9], [0, 0, 5], [4, 6, 0]])
    mask = tokens > 0
    p = pack_rows(tokens, mask)
    assert p.tokens_1N.tolist() == [[7, 8, 9, 5, 4, 6]]
    assert p.position_ids_1N.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert p.flat_index_N.tolist() == [0, 1, 2, 5, 6, 7]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("left", [False, True])
def test_packed_logprobs_and_values_equal_padded(arch: str, left: bool) -> None:
    policy = build_tiny_policy(TOK, arch=arch, size="0.1m", seed=1).float().eval()
    critic = ValueModel.from_policy(policy, seed=2).eval()
    tokens, mask, action = long_tailed_batch(TOK.vocab_size, left)
    with torch.no_grad():
        lp_pad = sequence_logprobs(policy, tokens, mask)
        lp_pack = sequence_logprobs(policy, tokens, mask, packed=True)
        v_pad = critic(tokens, mask)
        v_pack = critic(tokens, mask, packed=True)
    torch.testing.assert_close(lp_pack[action], lp_pad[action], rtol=0, atol=1e-5)
    torch.testing.assert_close(v_pack[mask], v_pad[mask], rtol=0, atol=1e-5)
    assert (lp_pack[~mask] == 0).all() and (v_pack[~mask] == 0).all()
    # the packed rows really see only themselves: a row alone gives the same log-probs
    b = 1
    alone = sequence_logprobs(policy, tokens[b : b + 1], mask[b : b + 1], packed=True)
    torch.testing.assert_close(alone[0], lp_pack[b], rtol=0, atol=1e-5)


def test_packed_micro_batches_respect_the_token_budget() -> None:
    lengths = [100, 64, 64, 30, 20, 10, 1, 1, 3]
    plan = packed_micro_batch_rows(lengths, range(len(lengths)), token_budget=64)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    for mb in plan:  # the one over-budget row runs alone; every other bin fits
        assert sum(lengths[i] for i in mb) <= 64 or mb == [0]
    # first-fit decreasing: 100 | 64 | 64 | 30+20+10+3+1 = 64 | the last 1
    assert plan == [[0], [1], [2], [3, 4, 5, 6, 8], [7]]
    with pytest.raises(ValueError, match="token_budget"):
        packed_micro_batch_rows(lengths, [0], token_budget=0)


def trajectories(vocab: int) -> list[Trajectory]:
    """Single-turn episodes of long-tailed lengths; the prompt is each row's first half."""
    g = torch.Generator().manual_seed(3)
    out = []
    for b, n in enumerate(max(n, 2) for n in LENGTHS):
        start = n // 2
        tokens = tuple(torch.randint(1, vocab, (n,), generator=g).tolist())
        action = tuple(t >= start for t in range(n))
        logp = tuple(-1.0 - 0.1 * t if a else 0.0 for t, a in enumerate(action))
        out.append(
            Trajectory(
                prompt_id=f"p{b // 2}",
                tokens=tokens,
                action_mask=action,
                rollout_logp=logp,
                versions=tuple(0 if a else -1 for a in action),
                turns=(Turn(start, n, n),),
                reward=float(b % 3 == 0),
                finish_reason="stop",
                group_id=f"p{b // 2}",
            )
        )
    return out


def run_step(packing: bool) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]], list]:
    """One trainer step of the ``sao`` preset (critic + actor) from the same weights;
    returns its stats, the gradients of every update and the updated weights."""
    policy = build_tiny_policy(TOK, arch="llama", size="0.1m", seed=4).float()
    critic = ValueModel.from_policy(policy, seed=5)
    settings = OptimSettings(token_budget=48, packing=packing, actor_lr=1e-3, critic_lr=1e-3)
    trainer = Trainer(policy, critic, PRESETS["sao"], settings)
    grads: dict[str, list[torch.Tensor]] = {"actor": [], "critic": []}
    apply = trainer._apply

    def spy(model, weights, optim, guard):  # type: ignore[no-untyped-def]
        params = policy.parameters() if model == "actor" else critic.parameters()
        grads[model] += [p.grad.clone() for p in params if p.grad is not None]
        return apply(model, weights, optim, guard)

    trainer._apply = spy  # type: ignore[method-assign]
    stats = trainer.step(trajectories(TOK.vocab_size))
    weights = [p.detach().clone() for p in [*policy.parameters(), *critic.parameters()]]
    return stats, grads, weights


def test_trainer_step_packed_equals_padded() -> None:
    stats_pad, grads_pad, w_pad = run_step(packing=False)
    stats_pack, grads_pack, w_pack = run_step(packing=True)
    for key in ("actor/loss", "critic/grad_norm", "actor/grad_norm"):
        torch.testing.assert_close(stats_pack[key], stats_pad[key], rtol=1e-5, atol=1e-6)
    for model in ("actor", "critic"):
        assert len(grads_pack[model]) == len(grads_pad[model]) > 0
        for gp, gq in zip(grads_pack[model], grads_pad[model], strict=True):
            torch.testing.assert_close(gp, gq, rtol=1e-4, atol=1e-6)
    for a, b in zip(w_pack, w_pad, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_padding_waste_of_the_padded_plan() -> None:
    # one micro-batch [2, 4, 4] padded to 4: 12 slots for 10 tokens
    assert padding_waste([4, 2, 4], 100) == pytest.approx(0.2)
    # budget 8: [2, 4] padded to 4 (8 slots) and [4] (4): again 12
    assert padding_waste([4, 2, 4], 8) == pytest.approx(0.2)
    # budget 4: each row alone, no padding
    assert padding_waste([4, 2, 4], 4) == 0.0
    assert worth_packing([4, 2, 4], 100) and not worth_packing([4, 2, 4], 4)  # 15%


def test_auto_packing_packs_a_cpu_step_only_when_it_pads_much() -> None:
    from sao.config import load_config

    assert load_config().train.packing == "auto"
    assert load_config(overrides=["train.packing=false"]).train.packing is False
    policy = build_tiny_policy(TOK, size="0.1m", seed=0)
    auto = Trainer(policy, None, PRESETS["grpo"], OptimSettings(packing="auto"))
    assert auto.auto_packing and auto._logprobs is not None

    def step(lengths: list[int]) -> bool:
        trajs = [
            Trajectory(
                prompt_id=f"p{i}",
                tokens=(1,) * n,
                action_mask=(False,) + (True,) * (n - 1),
                rollout_logp=(0.0,) + (-1.0,) * (n - 1),
                versions=(-1,) + (0,) * (n - 1),
                turns=(Turn(1, n, n),),
                reward=float(i % 2),
                finish_reason="stop",
                group_id="g",
            )
            for i, n in enumerate(lengths)
        ]
        auto.step(trajs)
        assert auto._logprobs is not None and auto._logprobs.packed == auto.packing
        return auto.packing

    assert step([40, 8, 8, 8]) is True  # padded to 40: 160 slots, 64 tokens
    assert step([12, 12, 12, 12]) is False  # no padding
    fixed = Trainer(policy, None, PRESETS["grpo"], OptimSettings())
    assert not fixed.auto_packing and fixed.packing is False
