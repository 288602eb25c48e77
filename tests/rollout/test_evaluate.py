"""Held-out evaluation (sao.runtime.evaluate; here for the rollout fixtures):
failures score 0 and are counted by reason; numbers an environment reports
(``StepResult.info["metric/..."]``) are averaged, over held-out episodes and
over each training batch; each evaluation's transcripts go to
``eval_samples.jsonl``, the console and (when on) W&B."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from pathlib import Path

from sao.rollout import EpisodeLimits
from sao.rundir.metrics import LiveView, RunLogger
from sao.runtime.buffer import TrajectoryBuffer
from sao.runtime.evaluate import evaluate
from sao.runtime.orchestrator import Orchestrator
from sao.runtime.runner import LocalRunner
from sao.runtime.staleness import StalenessGate
from sao.runtime.transcripts import EVAL_SAMPLES, EvalSamples, Transcript, last_evaluation
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


class Terminal(io.StringIO):
    """A stream that says it is a terminal (the rich live view)."""

    def isatty(self) -> bool:
        return True


def test_transcripts_are_written_shown_and_read_back(chatml_tok, tmp_path: Path) -> None:
    engine = ScriptedEngine(lambda prompt: Reply(c("answer 5")))
    runner = LocalRunner(JudgedTask(), engine, chatml_tok, EpisodeLimits(max_turns=1))
    r = asyncio.run(evaluate(runner, episodes=4, max_new_tokens=16))
    out = io.StringIO()
    with RunLogger(tmp_path, total_steps=3, tensorboard=False, stream=out) as logger:
        found = EvalSamples(tmp_path, chatml_tok, None, logger).record(20, r.trajectories)
    rows = [json.loads(x) for x in (tmp_path / EVAL_SAMPLES).read_text().splitlines()]
    assert rows == [t.to_dict() for t in found] and len(rows) == 4
    assert rows[0] == {
        "step": 20,
        "index": 0,
        "prompt": "user\nhi\nassistant\n",  # ChatML, its special tokens dropped
        "reply": "answer 5",
        "reward": 1.0,
        "finish_reason": "stop",
        "error": None,
    }
    # episode 1 scored 1.0 but its env crashed; 3 was never made: both count 0
    assert [(x["reward"], x["finish_reason"]) for x in rows] == [
        (1.0, "stop"),
        (0.0, "env_error"),
        (0.0, "stop"),
        (0.0, "error"),
    ]
    assert "judge crashed" in rows[1]["error"] and rows[3]["reply"] == ""
    lines = out.getvalue().splitlines()  # the first two, one line each
    assert lines == [
        "eval sample 0 (step 20): reward 1.000 stop | 'user\\nhi\\nassistant\\n' -> 'answer 5'",
        lines[1],
    ]
    assert lines[1].startswith("eval sample 1 (step 20): reward 0.000 env_error (")
    assert last_evaluation(tmp_path / EVAL_SAMPLES) == found
    assert Transcript.from_dict(rows[2]) == found[2]


def test_a_limit_keeps_the_first_episodes_and_zero_writes_nothing(
    chatml_tok, tmp_path: Path
) -> None:
    engine = ScriptedEngine(lambda prompt: Reply(c("answer 5")))
    runner = LocalRunner(JudgedTask(), engine, chatml_tok, EpisodeLimits(max_turns=1))
    r = asyncio.run(evaluate(runner, episodes=4, max_new_tokens=16))
    with RunLogger(tmp_path, total_steps=3, tensorboard=False, stream=io.StringIO()) as logger:
        EvalSamples(tmp_path, chatml_tok, 1, logger).record(0, r.trajectories)
        EvalSamples(tmp_path, chatml_tok, 1, logger).record(5, r.trajectories)
        assert EvalSamples(tmp_path, chatml_tok, 0, logger).record(9, r.trajectories) == []
    rows = [json.loads(x) for x in (tmp_path / EVAL_SAMPLES).read_text().splitlines()]
    assert [(x["step"], x["index"]) for x in rows] == [(0, 0), (5, 0)]
    assert [t.step for t in last_evaluation(tmp_path / EVAL_SAMPLES)] == [5]


def test_the_live_view_prints_a_reply_as_it_is(chatml_tok, tmp_path: Path) -> None:
    engine = ScriptedEngine(lambda prompt: Reply(c("answer 5")))
    runner = LocalRunner(JudgedTask(), engine, chatml_tok, EpisodeLimits(max_turns=1))
    r = asyncio.run(evaluate(runner, episodes=1, max_new_tokens=16))
    out = Terminal()
    with RunLogger(tmp_path, total_steps=3, tensorboard=False, stream=out) as logger:
        assert isinstance(logger.view, LiveView)
        logger.print("[cute] red cats, gate: [max_lag 1]")  # no rich markup in messages
        EvalSamples(tmp_path, chatml_tok, None, logger).record(0, r.trajectories)
    text = out.getvalue()
    assert "[cute] red cats, gate: [max_lag 1]" in text
    assert "eval sample 0 (step 0): reward 1.000 stop" in text and "'answer 5'" in text
