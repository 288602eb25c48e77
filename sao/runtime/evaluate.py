"""Held-out evaluation: greedy episodes on the task's eval split."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from sao.runtime.runner import EpisodeRunner
from sao.types import SamplingParams, Trajectory

GREEDY_TOP_K = 1
"""Evaluation decodes greedily (top-k 1), so held-out success is deterministic."""


@dataclass(frozen=True)
class EvalResult:
    """Held-out success (fraction of episodes with reward > 0.5) and details."""

    success: float
    reward_mean: float
    episodes: int
    env_errors: int
    mean_turns: float


async def evaluate(
    runner: EpisodeRunner,
    *,
    episodes: int,
    max_new_tokens: int,
    concurrency: int = 64,
) -> EvalResult:
    """Run ``episodes`` held-out episodes (indices ``0..episodes-1``) greedily."""
    n = min(episodes, runner.eval_size)
    sampling = SamplingParams(top_k=GREEDY_TOP_K, max_new_tokens=max_new_tokens)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> Trajectory:
        async with sem:
            return await runner.run(
                "eval", i, seed=i, prompt_id=f"eval/{i}", group_id="", sampling=sampling
            )

    trajs = await asyncio.gather(*(one(i) for i in range(n)))
    return EvalResult(
        success=sum(t.reward > 0.5 for t in trajs) / max(n, 1),
        reward_mean=sum(t.reward for t in trajs) / max(n, 1),
        episodes=n,
        env_errors=sum(t.finish_reason == "env_error" for t in trajs),
        mean_turns=sum(t.num_turns for t in trajs) / max(n, 1),
    )
