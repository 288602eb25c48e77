"""An agent episode's model calls -> training samples.

Every call the endpoint served is kept exactly: the prompt ids it was given,
the ids it sampled, their log-probabilities and weight versions. When each
call's prompt extends the previous call's prompt and reply token for token
(the agent only appended messages, so the endpoint rendered just the new
ones after the sampled reply), the calls are one trajectory, the replies its
action segments: ``concat``. Otherwise (the agent rewrote its history,
dropped messages, started a second conversation) each call is its own sample
with the episode's reward: ``per_call``. ``rollout.agent_export = "per_call"``
always exports per call.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from sao.types import CompletionFinish, SamplingParams, Trajectory, Turn

__all__ = ["AgentExport", "Call", "chained", "export_calls"]

AgentExport = Literal["concat", "per_call"]


@dataclass(frozen=True)
class Call:
    """One model call of an agent: what the engine was given and what it sampled."""

    prompt_ids: tuple[int, ...]
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish: CompletionFinish

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.prompt_ids + self.ids


def chained(calls: Sequence[Call]) -> bool:
    """True when every call's prompt starts with the previous call's prompt and reply."""
    return all(b.prompt_ids[: len(a.tokens)] == a.tokens for a, b in itertools.pairwise(calls))


def export_calls(
    calls: Sequence[Call],
    reward: float,
    *,
    mode: AgentExport,
    prompt_id: str,
    group_id: str,
    sampling: SamplingParams,
) -> list[Trajectory]:
    """One trajectory (``concat`` and the calls chain) or one per call; the
    outcome ``reward`` is on every sample's last action token."""
    if mode == "concat" and chained(calls):
        return [_concat(calls, reward, prompt_id, group_id, sampling)]
    return [
        _concat([call], reward, prompt_id, group_id, sampling, metrics={"call": float(i)})
        for i, call in enumerate(calls)
    ]


def _concat(
    calls: Sequence[Call],
    reward: float,
    prompt_id: str,
    group_id: str,
    sampling: SamplingParams,
    metrics: dict[str, float] | None = None,
) -> Trajectory:
    tokens = calls[-1].tokens
    n = len(tokens)
    mask, logp, versions = [False] * n, [0.0] * n, [-1] * n
    turns = []
    for i, call in enumerate(calls):
        start, end = len(call.prompt_ids), len(call.tokens)
        mask[start:end] = [True] * (end - start)
        logp[start:end] = call.logprobs
        versions[start:end] = call.versions
        obs_end = len(calls[i + 1].prompt_ids) if i + 1 < len(calls) else end
        turns.append(Turn(start, end, obs_end))
    return Trajectory(
        prompt_id=prompt_id,
        tokens=tokens,
        action_mask=tuple(mask),
        rollout_logp=tuple(logp),
        versions=tuple(versions),
        turns=tuple(turns),
        reward=reward,
        finish_reason="stop",
        sampling=sampling,
        group_id=group_id,
        metrics={"num_calls": float(len(calls)), **(metrics or {})},
    )
