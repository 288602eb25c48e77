"""Padding-free (packed) vs padded micro-batches: tokens/s of the trainer's
log-prob + value forward/backward on a long-tailed batch.

Both arms run, side by side in one process, what ``Trainer.update_actor`` and
``Trainer.update_critic`` run per micro-batch: the micro-batch plan of
``RankContext.micro_batches`` at ``--budget`` tokens, the actor's per-token
log-probabilities (``PolicyLogprobs``) and the critic's values, and one
backward through both. The batch has the lengths of agentic episodes:
``--long`` rows of ``--long-len`` tokens and ``--short`` rows of
``--short-len``. The arms alternate for ``--repeats`` rounds; each arm's
median wall time, its tokens/s (real tokens only) and the packed/padded
ratio are printed.

    PYTHONPATH=. python benchmarks/packing.py [--long 4] [--short 60] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sao.models.value import ValueModel
from sao.train.sharded import PolicyLogprobs, RankContext
from sao.types import Batch, Trajectory, Turn, collate

VOCAB = 256


def tiny_llama(max_len: int) -> LlamaForCausalLM:
    """The model of ``benchmarks/engine.py`` (~1M parameters), long enough positions."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_len,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def batch_of(lengths: list[int]) -> Batch:
    """Single-turn episodes: each row's first half is the prompt, the rest actions."""
    g = torch.Generator().manual_seed(1)
    trajs = []
    for b, n in enumerate(lengths):
        start = n // 2
        action = tuple(t >= start for t in range(n))
        trajs.append(
            Trajectory(
                prompt_id=f"p{b}",
                tokens=tuple(torch.randint(1, VOCAB, (n,), generator=g).tolist()),
                action_mask=action,
                rollout_logp=tuple(-1.0 if a else 0.0 for a in action),
                versions=tuple(0 if a else -1 for a in action),
                turns=(Turn(start, n, n),),
                reward=1.0,
                finish_reason="stop",
            )
        )
    return collate(trajs)


def fwd_bwd(
    policy: LlamaForCausalLM, critic: ValueModel, batch: Batch, budget: int, packed: bool
) -> tuple[float, int, int]:
    """One pass over the batch's micro-batches; (wall seconds, micro-batches, slots run)."""
    actor = PolicyLogprobs(policy, packed=packed)
    t0 = time.perf_counter()
    n_mb = slots = 0
    for mb, _ in RankContext().micro_batches(batch, budget, packed=packed):
        logp_BT = actor(mb.tokens_BT, mb.attention_mask_BT)
        values_BT = critic(mb.tokens_BT, mb.attention_mask_BT, packed=packed)
        m = mb.action_mask_BT
        ((logp_BT * m).sum() + (values_BT * m).pow(2).sum()).backward()
        n_mb += 1
        slots += int(mb.attention_mask_BT.sum()) if packed else mb.tokens_BT.numel()
    policy.zero_grad(set_to_none=True)
    critic.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, n_mb, slots


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--long", type=int, default=4)
    p.add_argument("--long-len", type=int, default=1024)
    p.add_argument("--short", type=int, default=60)
    p.add_argument("--short-len", type=int, default=64)
    p.add_argument("--budget", type=int, default=8192, help="train.token_budget")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    lengths = [args.long_len] * args.long + [args.short_len] * args.short
    batch = batch_of(lengths)
    policy = tiny_llama(max(lengths) + 1)
    critic = ValueModel.from_policy(policy)
    tokens = sum(lengths)
    fwd_bwd(policy, critic, batch, args.budget, packed=True)  # warm-up (and packing check)
    fwd_bwd(policy, critic, batch, args.budget, packed=False)
    times: dict[bool, list[float]] = {False: [], True: []}
    plan: dict[bool, tuple[int, int]] = {}
    for _ in range(args.repeats):
        for packed in (False, True):
            wall, n_mb, slots = fwd_bwd(policy, critic, batch, args.budget, packed)
            times[packed].append(wall)
            plan[packed] = (n_mb, slots)
    print(
        f"batch: {args.long}x{args.long_len} + {args.short}x{args.short_len} tokens "
        f"= {tokens} real tokens, token_budget={args.budget}, "
        f"torch threads={torch.get_num_threads()}, median of {args.repeats}"
    )
    for packed, name in ((False, "padded"), (True, "packed")):
        med = statistics.median(times[packed])
        n_mb, slots = plan[packed]
        print(
            f"  {name}: {n_mb} micro-batches, {slots} token slots, "
            f"{med:.3f} s, {tokens / med:,.0f} tokens/s"
        )
    ratio = statistics.median(times[False]) / statistics.median(times[True])
    print(f"  packed/padded tokens/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
