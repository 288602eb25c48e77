"""Prefix reuse across turns in the embedded engine: a multi-turn episode with
and without the prefix cache.

Each episode runs ``--turns`` turns on the tiny Llama of
``benchmarks/engine.py``: generate ``--reply`` tokens, append them and
``--obs`` scripted observation tokens, generate again, so the prompt grows to
several hundred tokens. With reuse off every turn prefills its whole history
(quadratic in the number of turns); with reuse on a turn prefills only the
last reply token and the observation. ``--episodes`` run concurrently (one KV
slot each). Prints the wall time of each arm (best of ``--repeats``), their
ratio, and the prompt tokens each prefilled and reused; both arms sample the
same seeded tokens.

    PYTHONPATH=. python benchmarks/prefix_reuse.py [--episodes 1] [--turns 10]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass

import torch

from benchmarks.engine import VOCAB, tiny_llama
from sao.rollout.embedded.engine import TorchEngine
from sao.types import SamplingParams


@dataclass(frozen=True)
class Arm:
    """One arm's result: best wall time, prompt tokens prefilled and reused, tokens sampled."""

    wall_s: float
    prefill_tokens: int
    reused_tokens: int
    tokens: list[list[int]]


async def episode(
    engine: TorchEngine, first: list[int], observations: list[list[int]], reply: int, seed: int
) -> list[int]:
    """One scripted episode; returns its final history (prompt, replies, observations)."""
    history = list(first)
    for t, obs in enumerate(observations):
        sp = SamplingParams(max_new_tokens=reply, seed=seed * 1000 + t)
        c = await engine.generate(history, sp)
        history += [*c.token_ids, *obs]
    return history


def run_arm(model: torch.nn.Module, args: argparse.Namespace, reuse: bool) -> Arm:
    """Time ``args.episodes`` concurrent episodes, best of ``args.repeats``."""
    rng = random.Random(0)
    firsts = [[rng.randrange(1, VOCAB) for _ in range(args.first)] for _ in range(args.episodes)]
    observations = [
        [[rng.randrange(1, VOCAB) for _ in range(args.obs)] for _ in range(args.turns)]
        for _ in range(args.episodes)
    ]
    width = args.first + args.turns * (args.reply + args.obs)
    best, prefilled, reused, histories = float("inf"), 0, 0, []
    for _ in range(args.repeats):  # a fresh engine each time: no cache from the last repeat
        with TorchEngine(
            model, max_batch_size=args.episodes, max_seq_len=width, prefix_cache=reuse
        ) as engine:

            async def serve(engine: TorchEngine = engine) -> list[list[int]]:
                calls = [
                    episode(engine, f, o, args.reply, seed=i)
                    for i, (f, o) in enumerate(zip(firsts, observations, strict=True))
                ]
                return list(await asyncio.gather(*calls))

            asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4)))  # warm-up
            start = time.perf_counter()
            histories = asyncio.run(serve())
            best = min(best, time.perf_counter() - start)
            prefilled = engine.prefill_tokens - 3
            reused = engine.reused_tokens
    return Arm(best, prefilled, reused, histories)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1, help="concurrent episodes")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--first", type=int, default=48, help="first prompt tokens")
    parser.add_argument("--reply", type=int, default=16, help="tokens generated per turn")
    parser.add_argument("--obs", type=int, default=32, help="observation tokens per turn")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = tiny_llama()
    width = args.first + args.turns * (args.reply + args.obs)
    print(
        f"tiny Llama, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
        f"{args.episodes} episode(s) x {args.turns} turns, first prompt {args.first}, "
        f"reply {args.reply}, observation {args.obs}: last prompt "
        f"{width - args.reply - args.obs} tokens; torch threads {torch.get_num_threads()}"
    )
    off = run_arm(model, args, reuse=False)
    on = run_arm(model, args, reuse=True)
    print(f"{'prefix cache':>12} {'wall s':>8} {'prefilled':>10} {'reused':>8}")
    for name, arm in (("off", off), ("on", on)):
        print(f"{name:>12} {arm.wall_s:>8.3f} {arm.prefill_tokens:>10} {arm.reused_tokens:>8}")
    same = "same" if on.tokens == off.tokens else "DIFFERENT"
    print(f"speed-up {off.wall_s / on.wall_s:.2f}x; sampled tokens: {same}")


if __name__ == "__main__":
    main()
