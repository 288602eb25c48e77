"""Episodes that fail end with a recorded reason, whatever failed: a blocking
environment, a tokenizer that raises, a huge observation (capped)."""

from __future__ import annotations

import asyncio
import time

from sao.rollout import EpisodeLimits, run_episode
from sao.rollout.chat import TRUNCATION_MARKER, cap_observation
from sao.types import Message, SamplingParams, StepResult, Trajectory
from tests.rollout.conftest import c
from tests.rollout.scripted import Reply, ScriptedEngine, ScriptedEnv, done, say

SAMPLING = SamplingParams(max_new_tokens=8)


def limits(**kw: object) -> EpisodeLimits:
    base: dict[str, object] = {"max_turns": 4, "max_total_tokens": 512}
    return EpisodeLimits(**(base | kw))  # type: ignore[arg-type]


async def episode(env, engine, tok, lim: EpisodeLimits, pid: str = "p0") -> Trajectory:
    return await run_episode(env, engine, tok, SAMPLING, lim, seed=1, prompt_id=pid)


class BlockingEnv(ScriptedEnv):
    """Blocks the event loop with a synchronous sleep inside ``async def step``."""

    def __init__(self, seconds: float) -> None:
        super().__init__("hi", [done(reward=1.0)])
        self.seconds = seconds

    async def step(self, action: str) -> StepResult:
        time.sleep(self.seconds)  # the mistake under test
        return await super().step(action)


class SleepingEnv(ScriptedEnv):
    """A well-behaved environment whose step awaits a short sleep."""

    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(0.05)
        return await super().step(action)


def test_blocking_env_times_out_by_name_and_spares_the_others(chatml_tok):
    lim = limits(step_timeout_s=0.3)

    async def both() -> tuple[Trajectory, Trajectory]:
        blocking = episode(BlockingEnv(0.6), ScriptedEngine([Reply(c("a"))]), chatml_tok, lim)
        polite_env = SleepingEnv("hi", [done(reward=1.0)])
        polite = episode(polite_env, ScriptedEngine([Reply(c("a"))]), chatml_tok, lim, "p1")
        a, b = await asyncio.gather(blocking, polite)
        return a, b

    bad, good = asyncio.run(both())
    assert bad.finish_reason == "timeout"
    assert "Env.step of BlockingEnv blocked the event loop for 0.6 s" in bad.error
    assert "asyncio.to_thread" in bad.error
    # the other episode was stalled by it, yet keeps its deadline: it finishes normally
    assert good.finish_reason == "stop" and good.reward == 1.0


def test_blocking_within_the_deadline_is_not_a_failure(chatml_tok):
    env = BlockingEnv(0.1)
    traj = asyncio.run(episode(env, ScriptedEngine([Reply(c("a"))]), chatml_tok, limits()))
    assert traj.finish_reason == "stop" and traj.reward == 1.0


def test_tokenizer_failure_is_an_error_with_its_message(chatml_tok, monkeypatch):
    def broken(*a: object, **k: object) -> str:
        raise RuntimeError("template exploded")

    env = ScriptedEnv("hi", [say("ok"), done()])
    engine = ScriptedEngine([Reply(c("a")), Reply(c("b"))])
    monkeypatch.setattr(chatml_tok, "apply_chat_template", broken)
    traj = asyncio.run(episode(env, engine, chatml_tok, limits()))
    assert traj.finish_reason == "env_error"  # the template rejected the messages
    assert "template exploded" in traj.error and traj.num_tokens == 0
    monkeypatch.undo()

    calls = {"n": 0}
    real = chatml_tok.encode

    def encode_once(*a: object, **k: object) -> list[int]:
        calls["n"] += 1
        if calls["n"] > 1:  # the prompt encodes, the observation does not
            raise RuntimeError("tokenizer crashed")
        return real(*a, **k)

    monkeypatch.setattr(chatml_tok, "encode", encode_once)
    traj = asyncio.run(episode(env.__class__("hi", [say("ok")]), engine, chatml_tok, limits()))
    assert traj.finish_reason == "error" and "tokenizer crashed" in traj.error
    assert traj.num_action_tokens == 1  # the reply before it is kept


def test_huge_observation_is_capped_with_a_marker(chatml_tok):
    huge = "a" * 1_000_000
    env = ScriptedEnv("hi", [say(huge), done()])
    engine = ScriptedEngine([Reply(c("b")), Reply(c("b"))])
    traj = asyncio.run(episode(env, engine, chatml_tok, limits(max_observation_tokens=10)))
    assert traj.finish_reason == "stop" and traj.metrics["observations_truncated"] == 1.0
    obs = traj.tokens[traj.turns[0].end : traj.turns[0].obs_end]
    # <|im_end|> \n <|im_start|> user\n (1+1+1+5) + 10 ids of content + the marker (one id a
    # character) + <|im_end|> \n <|im_start|> assistant\n (1+1+1+10): 21 ids around the content
    marker = TRUNCATION_MARKER.format(n=len(huge) - 10)
    assert len(obs) == 21 + 10 + len(marker)
    assert list(obs).count(c("a")[0]) == 10 + marker.count("a") + "assistant".count("a")


def test_cap_observation_arithmetic(chatml_tok):
    # one character is one token here: "abcdefghij" capped at 4 keeps "abcd"
    text, cut = cap_observation(chatml_tok, "abcdefghij", 4)
    assert cut == 1 and text == "abcd" + TRUNCATION_MARKER.format(n=6)
    assert cap_observation(chatml_tok, "abcd", 4) == ("abcd", 0)
    # messages share the budget in order: 3 + 2 of 5, the third is emptied
    msgs = (Message("user", "abc"), Message("tool", "defg"), Message("user", "hi"))
    out, cut = cap_observation(chatml_tok, msgs, 5)
    assert cut == 2 and isinstance(out, tuple)
    assert [m.content for m in out] == [
        "abc",
        "de" + TRUNCATION_MARKER.format(n=2),
        TRUNCATION_MARKER.format(n=2),
    ]
    assert cap_observation(chatml_tok, (5, 6, 7, 8), 2) == ((5, 6), 1)
