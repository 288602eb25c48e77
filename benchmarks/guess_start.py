"""Where a pretrained checkpoint starts on ``guess_number``: for each setting
(range, tries, shots, system prompt), held-out success greedy (what
``eval/success`` reports) and sampled at the preset's temperature, the mean
number of model turns, and the share of guesses inside the interval earlier
feedback allows (``guess/in_interval``: does the policy use the feedback?).
The multi-turn presets' range and prompt were chosen from this table.

    python benchmarks/guess_start.py                       # the default grid
    python benchmarks/guess_start.py --n 16 --shots 2 --show 2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from typing import Any

from sao.app.engines import context_window
from sao.envs.registry import make_task
from sao.models.fetch import resolve_model_path
from sao.models.loading import load_policy, load_tokenizer
from sao.rollout.agent import EpisodeLimits
from sao.rollout.embedded.engine import TorchEngine
from sao.runtime.evaluate import evaluate
from sao.runtime.runner import LocalRunner, samples
from sao.runtime.transcripts import transcripts
from sao.types import SamplingParams, Trajectory


def describe(trajs: list[Trajectory]) -> tuple[float, float, float]:
    """Success, mean model turns, mean in-interval share (over episodes with one)."""
    success = sum(t.reward > 0.5 for t in trajs) / len(trajs)
    turns = statistics.fmean(t.num_turns for t in trajs)
    inside = [
        t.metrics["metric/guess/in_interval"]
        for t in trajs
        if "metric/guess/in_interval" in t.metrics
    ]
    return success, turns, statistics.fmean(inside) if inside else float("nan")


async def play(
    model: Any, tokenizer: Any, task: Any, limits: EpisodeLimits, args: argparse.Namespace
) -> tuple[list[Trajectory], list[Trajectory]]:
    """The held-out episodes ``0..episodes-1`` played greedily and sampled."""
    context = context_window(model, limits.max_total_tokens)
    with TorchEngine(model, max_batch_size=64, max_seq_len=context, tokenizer=tokenizer) as engine:
        runner = LocalRunner(task, engine, tokenizer, limits)
        greedy = await evaluate(runner, episodes=args.episodes, max_new_tokens=args.max_new_tokens)
        sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
        played = await asyncio.gather(
            *(
                runner.run(
                    "eval", i, seed=1000 + i, prompt_id=f"s/{i}", group_id="", sampling=sampling
                )
                for i in range(args.episodes)
            )
        )
    return list(greedy.trajectories), [samples(p)[-1] for p in played]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--tries", type=int, nargs="+", default=[0], help="0: ceil(log2 n)+1")
    ap.add_argument("--shots", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--system", type=int, nargs="+", default=[0])
    ap.add_argument("--episodes", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--show", type=int, default=0)
    args = ap.parse_args()

    model_dir = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_dir)
    model = load_policy(model_dir)
    print(f"{model_dir}: {args.episodes} held-out episodes per setting")
    print(
        "| n | tries | shots | system | greedy success | sampled success | greedy turns "
        "| sampled turns | greedy in-interval | sampled in-interval | sampled episode tokens | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, tries, shots, system in itertools.product(args.n, args.tries, args.shots, args.system):
        options = {"n": n, "shots": shots, "system": bool(system), "seed": 0}
        if tries:
            options["max_turns"] = tries
        task = make_task("guess_number", **options)
        limits = EpisodeLimits(max_turns=task.max_turns, max_total_tokens=1024)
        t0 = time.perf_counter()

        greedy, sampled = asyncio.run(play(model, tokenizer, task, limits, args))
        g, s = describe(greedy), describe(sampled)
        tokens = statistics.fmean(len(t.tokens) for t in sampled)
        print(
            f"| {n} | {task.max_turns} | {shots} | {bool(system)} | {g[0]:.2f} | {s[0]:.2f} "
            f"| {g[1]:.2f} | {s[1]:.2f} | {g[2]:.2f} | {s[2]:.2f} | {tokens:.0f} "
            f"| {time.perf_counter() - t0:.0f} |",
            flush=True,
        )
        for t in transcripts(greedy, tokenizer, step=0, limit=args.show):
            print(t.block())
        for t in transcripts(sampled, tokenizer, step=0, limit=args.show):
            print(t.block())


if __name__ == "__main__":
    main()
