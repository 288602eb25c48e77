"""Held-out evaluation: greedy episodes on the task's eval split."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sao.runtime.runner import EpisodeRunner, samples

if TYPE_CHECKING:
    from sao.rollout.check import LogprobBudget
    from sao.rollout.engine import Engine
    from sao.runtime.trainers import TrainerHandle
from sao.types import FAILURES, SamplingParams, Trajectory

GREEDY_TOP_K = 1
"""Evaluation decodes greedily (top-k 1), so held-out success is deterministic."""


@dataclass(frozen=True)
class EvalResult:
    """Held-out success (fraction of episodes with reward > 0.5) and details.

    Failed episodes count as unsuccessful (a failure never scores); how many
    failed, by reason, is reported next to the success so that a broken
    environment cannot pass for a weaker policy."""

    success: float
    reward_mean: float
    episodes: int
    env_errors: int
    mean_turns: float
    timeouts: int = 0
    errors: int = 0
    reported: dict[str, float] = field(default_factory=dict)
    """Mean of each ``metric/NAME`` the environments reported (``StepResult.info``),
    over the episodes that reported it; logged as ``eval/NAME``."""
    trajectories: tuple[Trajectory, ...] = field(default=(), repr=False)
    """The episodes, held-out episode ``i`` at position ``i`` (for transcripts)."""

    def metrics(self) -> dict[str, float]:
        """``eval/...`` metrics of a run."""
        return {
            "eval/success": self.success,
            "eval/reward_mean": self.reward_mean,
            "eval/env_error": float(self.env_errors),
            "eval/timeout": float(self.timeouts),
            "eval/error": float(self.errors),
        } | {f"eval/{k.removeprefix('metric/')}": v for k, v in self.reported.items()}


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
            played = await runner.run(
                "eval", i, seed=i, prompt_id=f"eval/{i}", group_id="", sampling=sampling
            )
            return samples(played)[-1]  # an agent's samples share the episode's reward

    trajs = await asyncio.gather(*(one(i) for i in range(n)))
    reasons = Counter(t.finish_reason for t in trajs)
    rewards = [0.0 if t.finish_reason in FAILURES else t.reward for t in trajs]
    return EvalResult(
        success=sum(r > 0.5 for r in rewards) / max(n, 1),
        reward_mean=sum(rewards) / max(n, 1),
        episodes=n,
        env_errors=reasons["env_error"],
        mean_turns=sum(t.num_turns for t in trajs) / max(n, 1),
        timeouts=reasons["timeout"],
        errors=reasons["error"],
        reported=reported_means(trajs),
        trajectories=tuple(trajs),
    )


def reported_means(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Mean of each ``metric/NAME`` entry of ``trajs``' metrics (what their
    environments reported), over the trajectories that hold it."""
    values: dict[str, list[float]] = {}
    for t in trajs:
        for k, v in t.metrics.items():
            if k.startswith("metric/"):
                values.setdefault(k, []).append(v)
    return {k: sum(v) / len(v) for k, v in sorted(values.items())}


async def logprob_gate(
    budget: LogprobBudget,
    sampling: SamplingParams,
    handle: TrainerHandle,
    runner: EpisodeRunner,
    engine: Engine | None,
    echo: Callable[[str], None],
) -> None:
    """Refuse to train when the engine's log-probabilities and the trainer's
    differ by more than ``budget`` (``train.logprob_budget``) on up to 4
    held-out episodes (a max of 0 skips the check)."""
    if budget.max_abs_delta <= 0:
        return
    played = await asyncio.gather(
        *(
            runner.run("eval", i, seed=i, prompt_id=f"check-{i}", group_id="", sampling=sampling)
            for i in range(min(4, runner.eval_size))
        )
    )
    scored = [t for p in played for t in samples(p) if t.num_action_tokens > 0]
    if not scored:  # failed episodes hold no sampled token
        echo("log-prob check skipped: no held-out episode sampled a token")
        return
    report = await handle.score(scored, sampling, engine=engine)
    echo(f"log-prob check: max |delta| {report.max_abs_delta:.2e}, k3 {report.k3_kl:.2e}")
    report.check(budget)
