"""An episode caught between turns is snapshot (tokens, log-probs, versions,
turns, the env's state) and continued from there: only the current turn is
generated again, and the result equals an uninterrupted episode."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

from sao.rollout import EpisodeLimits, run_episode
from sao.rollout.resume import EpisodeResume, resume_points
from sao.types import RestorableEnv, SamplingParams, StepResult, Trajectory
from tests.rollout.conftest import c
from tests.rollout.scripted import Reply, ScriptedEngine

SAMPLING = SamplingParams(max_new_tokens=8)
LIMITS = EpisodeLimits(max_turns=4, max_total_tokens=256)
KEY = "p0#g#7"  # run_episode's key: prompt_id#group_id#seed


class CountEnv:
    """Counts replies; the third ends the episode with reward = replies seen."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def reset(self, seed: int) -> str:
        return "hi"

    async def step(self, action: str) -> StepResult:
        self.seen.append(action)
        if len(self.seen) == 3:
            return StepResult(None, done=True)
        return StepResult(f"n{len(self.seen)}", reward=0.5)

    def score(self) -> float:
        return float(len(self.seen))

    def state_dict(self) -> dict[str, object]:
        return {"seen": list(self.seen)}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.seen = list(state["seen"])  # type: ignore[call-overload]


class GatedEngine(ScriptedEngine):
    """Waits before its ``gate_at``-th generation until released."""

    def __init__(self, replies: list[Reply], gate_at: int) -> None:
        super().__init__(replies)
        self.gate_at, self.waiting, self.release = gate_at, asyncio.Event(), asyncio.Event()

    async def generate(self, prompt_ids, sampling):  # type: ignore[no-untyped-def]
        if len(self.calls) + 1 == self.gate_at:
            self.waiting.set()
            await self.release.wait()
        return await super().generate(prompt_ids, sampling)


def replies() -> list[Reply]:
    return [
        Reply(c("ab"), versions=(0, 0)),
        Reply(c("cd"), versions=(1, 1)),
        Reply(c("ef"), versions=(2, 2)),
    ]


def play(env, engine, tok, resume: EpisodeResume | None = None) -> Trajectory:
    return run_episode(
        env, engine, tok, SAMPLING, LIMITS, seed=7, prompt_id="p0", group_id="g", resume=resume
    )


def test_snapshot_between_turns_then_continue(chatml_tok):
    tok = chatml_tok
    assert isinstance(CountEnv(), RestorableEnv)
    whole = asyncio.run(play(CountEnv(), ScriptedEngine(replies()), tok))

    async def interrupted() -> EpisodeResume:
        engine = GatedEngine(replies(), gate_at=3)
        task = asyncio.create_task(play(CountEnv(), engine, tok))
        await engine.waiting.wait()  # waiting for its third reply: between turns
        snap = resume_points.take(KEY)
        task.cancel()
        assert snap is not None
        return snap

    snap = asyncio.run(interrupted())
    assert EpisodeResume.from_dict(json.loads(json.dumps(snap.to_dict()))) == snap
    assert snap.env_state == {"seen": ["ab", "cd"]} and len(snap.turns) == 2
    assert snap.tokens == whole.tokens[: whole.turns[2].start]

    env = CountEnv()
    env.load_state_dict(snap.env_state)
    engine = ScriptedEngine(replies()[2:])
    resumed = asyncio.run(play(env, engine, tok, resume=snap))
    assert len(engine.calls) == 1  # only the interrupted turn is generated again
    assert engine.calls[0][0] == snap.tokens
    for name in ("tokens", "action_mask", "rollout_logp", "versions", "reward"):
        assert getattr(resumed, name) == getattr(whole, name), name
    spans = [(t.start, t.end, t.obs_end, t.reward) for t in resumed.turns]
    assert spans == [(t.start, t.end, t.obs_end, t.reward) for t in whole.turns]
    assert resumed.finish_reason == "stop" and resumed.total_reward == 3.0 + 0.5 + 0.5


def test_busy_or_unrestorable_episodes_offer_no_snapshot(chatml_tok):
    tok = chatml_tok

    class Plain(CountEnv):
        state_dict = None  # type: ignore[assignment]

    async def caught(env) -> EpisodeResume | None:
        engine = GatedEngine(replies(), gate_at=2)
        task = asyncio.create_task(play(env, engine, tok))
        await engine.waiting.wait()
        snap = resume_points.take(KEY)
        task.cancel()
        return snap

    assert not isinstance(Plain(), RestorableEnv)
    assert asyncio.run(caught(Plain())) is None
    # after an episode ends nothing is left behind
    asyncio.run(play(CountEnv(), ScriptedEngine(replies()), tok))
    assert resume_points.take(KEY) is None
