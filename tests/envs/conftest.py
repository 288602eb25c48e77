"""A tiny driver that plays scripted policies against environments.

``play(env, actions)`` resets, steps with the given texts until the env says
done, and scores. ``play_policy(env, policy)`` lets the policy react to each
observation. ``replay(env, conversation)`` checks that a demonstration's
observations are exactly the ones the env produces for its actions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sao.envs.base import Conversation, Env, Observation, StepResult


@dataclass
class Episode:
    """What a scripted episode produced."""

    first: Observation
    results: list[StepResult] = field(default_factory=list)
    score: float = 0.0

    @property
    def observations(self) -> list[Observation | None]:
        """Observations after each step, in order."""
        return [r.observation for r in self.results]

    @property
    def done(self) -> bool:
        """Whether the last step ended the episode."""
        return bool(self.results) and self.results[-1].done


def text_of(obs: Observation | None) -> str:
    """The text a policy reads from an observation (the last message's content)."""
    if obs is None:
        return ""
    if isinstance(obs, str):
        return obs
    last = obs[-1]
    return getattr(last, "content", "")


async def _run(env: Env, policy: Callable[[str], str], seed: int, max_steps: int) -> Episode:
    ep = Episode(first=await env.reset(seed))
    obs: Observation | None = ep.first
    for _ in range(max_steps):
        result = await env.step(policy(text_of(obs)))
        ep.results.append(result)
        obs = result.observation
        if result.done:
            break
    ep.score = env.score()
    return ep


def play_policy(
    env: Env, policy: Callable[[str], str], *, seed: int = 0, max_steps: int = 50
) -> Episode:
    """Play ``policy`` (latest observation text -> action) until done or ``max_steps``."""
    return asyncio.run(_run(env, policy, seed, max_steps))


def play(env: Env, actions: Sequence[str], *, seed: int = 0) -> Episode:
    """Play the scripted ``actions`` in order, stopping early when the env is done."""
    it = iter(actions)
    return play_policy(env, lambda _obs: next(it), seed=seed, max_steps=len(actions))


def replay(env: Env, conversation: Conversation) -> Episode:
    """Play a demonstration's assistant turns and assert its observations match the env's."""
    actions = [m.content for m in conversation if m.role == "assistant"]
    ep = play(env, actions)
    first = ep.first if isinstance(ep.first, tuple) else None
    n_head = len(first) if first else 1
    observed = [m.content for m in conversation[n_head:] if m.role != "assistant"]
    produced = [o for o in ep.observations if isinstance(o, str)]
    assert observed == produced, (observed, produced)
    return ep
