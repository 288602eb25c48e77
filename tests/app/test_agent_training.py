"""End to end: an agent written with the plain ``openai`` client, trained by
``sao train`` through the agent endpoint, raises its reward (the SayA toy
task of test_learning, played as an agent function and as a command)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from sao.agents import AgentTask
from sao.app.run import train
from sao.config import load_config

pytest.importorskip("openai")

AGENT_SCRIPT = """
import asyncio, json, os
from openai import AsyncOpenAI

async def main():
    client = AsyncOpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY name the episode
    task = json.loads(os.environ["SAO_TASK"])
    r = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["prompt"]}]
    )
    print(r.choices[0].message.content[:4].count("a") / 4)

asyncio.run(main())
"""


async def say_a(client: Any, problem: dict[str, str]) -> float:
    reply = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": problem["prompt"]}]
    )
    return reply.choices[0].message.content[:4].count("a") / 4


def overrides(tmp_path: Path, policy: Path, *extra: str) -> list[str]:
    return [
        f"model.path={policy}", f"log.run_dir={tmp_path / 'run'}", "log.live=false",
        "log.tensorboard=false", "log.plots=false", "train.batch_size=16",
        "train.actor_lr=3e-3", "train.critic_lr=3e-3", "rollout.in_flight=16",
        "rollout.max_new_tokens=4", "rollout.max_turns=1", "rollout.max_total_tokens=64",
        "eval.every=100", "eval.episodes=4", "log.checkpoint_every=100", *extra,
    ]  # fmt: skip


def rewards(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/reward_mean"] for r in rows if "train/reward_mean" in r]


@pytest.mark.slow
def test_an_openai_client_agent_learns(tmp_path: Path, tiny_policy: Path) -> None:
    task = AgentTask(train=[{"prompt": "a"}], eval=[{"prompt": "a"}] * 4, run=say_a)
    extra = ("algo=sao", "algo.critic_pretrain_steps=2", "train.steps=16")
    cfg = load_config(overrides=overrides(tmp_path, tiny_policy, *extra))
    got = rewards(train(cfg, task=task))
    first, last = sum(got[:3]) / 3, sum(got[-3:]) / 3
    assert last > first + 0.2, (first, last)


def test_a_command_line_agent_trains(tmp_path: Path, tiny_policy: Path) -> None:
    script = tmp_path / "agent.py"
    script.write_text(AGENT_SCRIPT)
    task = AgentTask(train=[{"prompt": "a"}], eval=[], command=[sys.executable, str(script)])
    extra = ("algo=grpo", "algo.group_size=4", "train.steps=2", "rollout.in_flight=8")
    extra += ("train.batch_size=8", "train.logprob_budget=0")
    cfg = load_config(overrides=overrides(tmp_path, tiny_policy, *extra))
    got = rewards(train(cfg, task=task))
    assert len(got) == 2 and all(0.0 <= r <= 1.0 for r in got)


async def sdk_agent(client: Any, problem: dict[str, str]) -> float:
    """The same agent written with the openai-agents SDK."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # no trace export: nothing leaves the machine
    agent = Agent(
        name="say-a",
        instructions="a",
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
    )
    result = await Runner.run(agent, problem["prompt"], max_turns=1)
    return str(result.final_output)[:4].count("a") / 4


def test_an_openai_agents_sdk_agent_trains(tmp_path: Path, tiny_policy: Path) -> None:
    pytest.importorskip("agents")
    task = AgentTask(train=[{"prompt": "a"}], eval=[{"prompt": "a"}] * 2, run=sdk_agent)
    extra = ("algo=sao", "algo.critic_pretrain_steps=0", "train.steps=2", "train.batch_size=8")
    cfg = load_config(overrides=overrides(tmp_path, tiny_policy, *extra, "rollout.in_flight=8"))
    run_dir = train(cfg, task=task)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # an empty reply makes the SDK raise (ModelBehaviorError): that episode fails,
    # recorded, and the run goes on
    assert rows[-1]["version"] == 2.0 and len(rewards(run_dir)) == 2
