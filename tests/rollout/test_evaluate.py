"""Held-out evaluation (sao.runtime.evaluate; here for the rollout fixtures):
failures score 0 and are counted by reason; numbers an environment reports
(``StepResult.info["metric/..."]``) are averaged, over held-out episodes and
over each training batch."""

from __future__ import annotations

import asyncio
import dataclasses

from sao.rollout import EpisodeLimits
from sao.runtime.buffer import TrajectoryBuffer
from sao.runtime.evaluate import evaluate
from sao.runtime.orchestrator import Orchestrator
from sao.runtime.runner import LocalRunner
from sao.runtime.staleness import StalenessGate
from sao.types import Env, SamplingParams, StepResult, failed_trajectory
from tests.rollout.conftest import c
from tests.rollout.scripted import Reply, ScriptedEngine


class JudgedEnv:
    """Episode i: 0 scores 1, 1 scores 1 then crashes, 2 scores 0, 3 cannot be made."""

    def __init__(self, index: int) -> None:
        self.index = index

    async def reset(self, seed: int) -> str:
        return "hi"

    async def step(self, action: str) -> StepResult:
        if self.index == 1:
            raise RuntimeError("judge crashed")
        return StepResult(None, done=True, info={"metric/polite": float(self.index), "n": 5})

    def score(self) -> float:
        return 1.0 if self.index < 2 else 0.0


class JudgedTask:
    name = "judged"
    eval_size = 4

    def make_env(self, split: str, index: int) -> Env:
        if index == 3:
            raise ValueError("no such problem")
        return JudgedEnv(index)

    def demonstrations(self, n: int, *, seed: int) -> list[object]:
        return []


def test_failures_score_zero_and_reported_metrics_are_averaged(chatml_tok):
    engine = ScriptedEngine(lambda prompt: Reply(c("a")))
    runner = LocalRunner(JudgedTask(), engine, chatml_tok, EpisodeLimits(max_turns=1))
    r = asyncio.run(evaluate(runner, episodes=4, max_new_tokens=4))
    # only episode 0 succeeds: 1 crashed after scoring 1.0, 2 scored 0, 3 was never made
    assert r.success == 0.25 and r.reward_mean == 0.25
    assert (r.env_errors, r.timeouts, r.errors) == (1, 0, 1)
    m = r.metrics()
    assert m["eval/success"] == 0.25 and m["eval/env_error"] == 1.0 and m["eval/error"] == 1.0
    assert m["eval/polite"] == (0.0 + 2.0) / 2  # episodes 0 and 2 reported it
    assert "eval/n" not in m  # only metric/... entries are reported


class NoRunner:
    def metrics(self) -> dict[str, float]:
        return {}


def test_a_training_batch_reports_the_mean_of_each_env_metric() -> None:
    gate = StalenessGate(0, 3)
    sampling = SamplingParams(max_new_tokens=4)
    orch = Orchestrator(
        NoRunner(),  # type: ignore[arg-type]
        sampling,
        gate=gate,
        buffer=TrajectoryBuffer(gate, group_size=1, dynamic_sampling=False),
        in_flight=1,
        group_size=1,
        seed=0,
    )
    base = failed_trajectory("p", "g", sampling, "stop", "")
    batch = [
        dataclasses.replace(base, metrics={"metric/format/missing_answer": 1.0, "num_turns": 1.0}),
        dataclasses.replace(base, metrics={"metric/format/missing_answer": 0.0}),
        dataclasses.replace(base, metrics={"metric/format/missing_answer": 1.0}),
        dataclasses.replace(base, metrics={}),  # reported nothing: not counted
    ]
    m = orch.runtime_metrics(batch, 0)
    assert m["format/missing_answer"] == (1.0 + 0.0 + 1.0) / 3
    assert "num_turns" not in m and "metric/format/missing_answer" not in m
