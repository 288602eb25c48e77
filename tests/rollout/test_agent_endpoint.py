"""The OpenAI-compatible agent endpoint, through the real ``openai`` client:
token-exact recording, tool calls, episode ids, concat vs per-call export,
and agents that fail (sao.agents; here for the rollout fixtures)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from sao.agents import AgentEndpoint, AgentRunner, AgentTask, parse_tool_calls
from sao.types import SamplingParams, Trajectory
from tests.rollout.conftest import IM_END, IM_START, c
from tests.rollout.scripted import Reply, ScriptedEngine

openai = pytest.importorskip("openai")

SAMPLING = SamplingParams(max_new_tokens=64)
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'


def chatml(role: str, text: str) -> list[int]:
    return [IM_START, *c(f"{role}\n{text}"), IM_END, *c("\n")]


GEN = [IM_START, *c("assistant\n")]


async def with_endpoint(
    tok: Any, engine: ScriptedEngine, body: Callable[[AgentEndpoint], Awaitable[Any]]
) -> Any:
    endpoint = AgentEndpoint(engine, tok)
    await endpoint.start()
    try:
        return await body(endpoint)
    finally:
        await endpoint.close()


def test_parse_tool_calls() -> None:
    text, calls = parse_tool_calls(f"ok {CALL} <tool_call>not json</tool_call>")
    assert text == "ok  <tool_call>not json</tool_call>"
    assert [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls] == [
        ("add", {"a": 2})
    ]


def test_a_conversation_is_recorded_token_for_token(chatml_tok) -> None:
    engine = ScriptedEngine([Reply(c("calc 2")), Reply((*c("answer 4"), IM_END))])

    async def agent(client: Any, problem: str) -> float:
        messages: list[dict[str, Any]] = [{"role": "user", "content": problem}]
        first = await client.chat.completions.create(model="policy", messages=messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "is 4"}]
        second = await client.chat.completions.create(model="policy", messages=messages)
        return float(second.choices[0].message.content == "answer 4")

    async def body(endpoint: AgentEndpoint) -> Trajectory | list[Trajectory]:
        runner = AgentRunner(AgentTask(train=["hi"], eval=[], run=agent), endpoint)
        return await runner.run(
            "train", 0, seed=3, prompt_id="train/0", group_id="train/0", sampling=SAMPLING
        )

    traj = asyncio.run(with_endpoint(chatml_tok, engine, body))
    assert isinstance(traj, Trajectory) and traj.reward == 1.0
    # prompt, reply 1 (cut short: no stop token, so <|im_end|>\n closes it as
    # observation), the new user message, the generation prompt, reply 2 with its stop
    p1 = chatml("user", "hi") + GEN
    obs = [IM_END, *c("\n"), *chatml("user", "is 4"), *GEN]
    expected = [*p1, *c("calc 2"), *obs, *c("answer 4"), IM_END]
    assert list(traj.tokens) == expected
    assert [list(p) for p, _ in engine.calls] == [p1, [*p1, *c("calc 2"), *obs]]
    assert [(t.start, t.end) for t in traj.turns] == [
        (len(p1), len(p1) + 6),
        (len(expected) - 9, len(expected)),
    ]
    assert sum(traj.action_mask) == 6 + 9


def test_tool_calls_come_back_in_openai_format(chatml_tok) -> None:
    engine = ScriptedEngine(lambda prompt: Reply(c("ok")))  # decoded as CALL below: the
    # character tokenizer of these tests cannot spell the tags

    async def body(endpoint: AgentEndpoint) -> Any:
        endpoint.open("e1", SAMPLING)
        client = openai.AsyncOpenAI(base_url=f"{endpoint.url}/episodes/e1/v1", api_key="x")
        import sao.agents.endpoint as ep_mod

        real = ep_mod.decode_reply
        ep_mod.decode_reply = lambda tok, ids, **k: CALL  # type: ignore[assignment]
        try:
            r = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}]
            )
        finally:
            ep_mod.decode_reply = real  # type: ignore[assignment]
        return r.choices[0]

    choice = asyncio.run(with_endpoint(chatml_tok, engine, body))
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2}


def test_episode_ids_and_bad_requests(chatml_tok) -> None:
    engine = ScriptedEngine(lambda prompt: Reply(c("ok")))
    msgs = [{"role": "user", "content": "hi"}]

    async def body(endpoint: AgentEndpoint) -> list[Any]:
        endpoint.open("e1", SAMPLING)
        base = f"{endpoint.url}/v1"
        out: list[Any] = []
        by_key = openai.AsyncOpenAI(base_url=base, api_key="e1")
        out.append((await by_key.chat.completions.create(model="policy", messages=msgs)).usage)
        by_header = openai.AsyncOpenAI(
            base_url=base, api_key="-", default_headers={"X-Episode-Id": "e1"}
        )
        done = await by_header.completions.create(model="policy", prompt="hi")
        out.append(done.choices[0].text)
        gone = f"{endpoint.url}/episodes/gone/v1"
        for client, model in [
            (openai.AsyncOpenAI(base_url=base, api_key="-"), "policy"),  # no episode id
            (openai.AsyncOpenAI(base_url=gone, api_key="-"), "policy"),
            (by_key, "gpt-4o"),
        ]:
            try:
                await client.chat.completions.create(model=model, messages=msgs)
            except openai.APIStatusError as err:
                out.append((err.status_code, err.body["message"]))
        return out

    usage, text, *errors = asyncio.run(with_endpoint(chatml_tok, engine, body))
    assert usage.prompt_tokens == len(chatml("user", "hi") + GEN) and usage.completion_tokens == 2
    assert text == "ok"
    assert errors[0][0] == 400 and "no episode id" in errors[0][1]
    assert errors[1][0] == 404 and "'gone' is not running" in errors[1][1]
    assert errors[2][0] == 404 and "'gpt-4o' is not served here; use 'policy'" in errors[2][1]


def test_a_rewritten_history_exports_one_sample_per_call(chatml_tok) -> None:
    engine = ScriptedEngine(lambda prompt: Reply(c("ab")))

    async def agent(client: Any, problem: str) -> float:
        for text in ("one", "two"):  # a fresh conversation each time
            msgs = [{"role": "user", "content": text}]
            await client.chat.completions.create(model="policy", messages=msgs)
        return 0.5

    async def body(endpoint: AgentEndpoint) -> Any:
        runner = AgentRunner(AgentTask(train=["x"], eval=[], run=agent), endpoint)
        return await runner.run(
            "train", 0, seed=1, prompt_id="train/0", group_id="train/0", sampling=SAMPLING
        )

    out = asyncio.run(with_endpoint(chatml_tok, engine, body))
    assert isinstance(out, list) and [t.reward for t in out] == [0.5, 0.5]
    assert [list(t.tokens) for t in out] == [
        chatml("user", "one") + GEN + c("ab"),
        chatml("user", "two") + GEN + c("ab"),
    ]


@pytest.mark.parametrize(
    ("agent", "reason", "message"),
    [
        ("raise", "error", "the agent raised RuntimeError: tool broke"),
        ("hang", "timeout", "did not finish within AgentTask.timeout_s=0.3 s"),
        ("nan", "error", "the agent returned nan, not a finite reward"),
        ("silent", "error", "finished without calling the model"),
    ],
)
def test_failing_agents_fail_their_episode(chatml_tok, agent, reason, message) -> None:
    async def run(client: Any, problem: str) -> float:
        if agent == "silent":
            return 1.0
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}]
        )
        if agent == "raise":
            raise RuntimeError("tool broke")
        if agent == "hang":
            await asyncio.sleep(3600)
        return float("nan")

    async def body(endpoint: AgentEndpoint) -> Any:
        # only the hanging agent meets its timeout: on a loaded machine the others'
        # one HTTP call could take longer than 0.3 s and be reported as a timeout
        task = AgentTask(train=["x"], eval=[], run=run, timeout_s=0.3 if agent == "hang" else 30.0)
        return await AgentRunner(task, endpoint).run(
            "train", 0, seed=1, prompt_id="train/0", group_id="train/0", sampling=SAMPLING
        )

    traj = asyncio.run(with_endpoint(chatml_tok, ScriptedEngine(lambda p: Reply(c("a"))), body))
    assert traj.finish_reason == reason and message in traj.error
