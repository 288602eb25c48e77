"""Scripted engines and environments for the agent-loop tests.

``ScriptedEngine`` returns predetermined replies (ids, log-probabilities,
versions), optionally after a delay; ``ModelEngine`` samples from a real
causal LM with one full forward pass per token (a slow but obviously exact
reference); ``ScriptedEnv`` replays a list of step results, exceptions or
hangs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sao.rollout.weights import DiskWeights, TensorWeights, WeightSource
from sao.types import Completion, CompletionFinish, SamplingParams, StepResult

HANG = "hang"
"""A ``ScriptedEnv`` step (or reset) that never returns."""


@dataclass(frozen=True)
class Reply:
    """One scripted generation: ids, and optionally their logprobs/versions."""

    ids: Sequence[int]
    finish: CompletionFinish = "stop"
    logprobs: tuple[float, ...] | None = None
    versions: tuple[int, ...] | None = None


class ScriptedEngine:
    """An Engine whose replies are scripted; records every call.

    A reply longer than ``max_new_tokens`` is cut and finishes with
    ``length``. Default log-probability of the k-th token of a reply:
    ``-0.1 * (k + 1)``; default version: the engine's current version.
    """

    def __init__(
        self,
        replies: Sequence[Reply] | Callable[[tuple[int, ...]], Reply],
        *,
        delay_s: float = 0.0,
        max_seq_len: int | None = None,
    ) -> None:
        self._replies = replies if callable(replies) else list(replies)
        self._delay_s = delay_s
        self._version = 0
        self.calls: list[tuple[tuple[int, ...], SamplingParams]] = []
        if max_seq_len is not None:
            self.max_seq_len = max_seq_len

    @property
    def version(self) -> int:
        return self._version

    @property
    def weight_sources(self) -> tuple[type, ...]:
        return (TensorWeights, DiskWeights)

    async def update_weights(self, source: WeightSource) -> None:
        self._version = source.version

    async def aclose(self) -> None:
        pass

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        prompt = tuple(prompt_ids)
        self.calls.append((prompt, sampling))
        if self._delay_s:
            await asyncio.sleep(self._delay_s)
        reply = self._replies(prompt) if callable(self._replies) else self._replies.pop(0)
        n = min(len(reply.ids), sampling.max_new_tokens)
        logprobs = reply.logprobs or tuple(-0.1 * (k + 1) for k in range(len(reply.ids)))
        versions = reply.versions or (self._version,) * len(reply.ids)
        return Completion(
            token_ids=tuple(reply.ids[:n]),
            logprobs=tuple(logprobs[:n]),
            versions=tuple(versions[:n]),
            finish_reason="length" if n < len(reply.ids) else reply.finish,
        )


class ScriptedEnv:
    """An Env replaying ``steps`` (a StepResult, an exception to raise,
    :data:`HANG`, or any other object to return as is)."""

    def __init__(
        self,
        first: object,
        steps: Sequence[object] = (),
        *,
        score: float | Exception = 1.0,
        ignore_cancel: bool = False,
    ) -> None:
        self.first = first
        self.steps = list(steps)
        self.score_value = score
        self.ignore_cancel = ignore_cancel
        self.actions: list[str] = []
        self.seeds: list[int] = []
        self.score_calls = 0
        self.unwinding = self.unwound = False

    async def _hang(self) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if not self.ignore_cancel:
                raise
            # A slow clean-up that swallows the first cancellation.
            self.unwinding = True
            await asyncio.sleep(0.5)
            self.unwound = True

    async def _play(self, item: object) -> object:
        if isinstance(item, Exception):
            raise item
        if isinstance(item, str) and item == HANG:
            await self._hang()
        return item

    async def reset(self, seed: int) -> object:
        self.seeds.append(seed)
        return await self._play(self.first)

    async def step(self, action: str) -> object:
        self.actions.append(action)
        return await self._play(self.steps.pop(0))

    def score(self) -> float:
        self.score_calls += 1
        if isinstance(self.score_value, Exception):
            raise self.score_value
        return self.score_value


def say(text: str, *, reward: float = 0.0) -> StepResult:
    """A step result that continues the episode with ``text``."""
    return StepResult(observation=text, reward=reward, done=False)


def done(reward: float = 0.0) -> StepResult:
    """A step result that ends the episode."""
    return StepResult(observation=None, reward=reward, done=True)


class ModelEngine:
    """Reference Engine: samples from ``model`` (fp32 logits, temperature,
    optional top-k) with one full forward pass per token and no cache."""

    def __init__(self, model: torch.nn.Module, *, eos_id: int, seed: int = 0) -> None:
        self.model = model
        self.eos_id = eos_id
        self._gen = torch.Generator().manual_seed(seed)
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    @property
    def weight_sources(self) -> tuple[type, ...]:
        return (TensorWeights,)

    async def update_weights(self, source: WeightSource) -> None:
        assert isinstance(source, TensorWeights)
        self.model.load_state_dict(dict(source.state_dict))
        self._version = source.version

    async def aclose(self) -> None:
        pass

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        ids, out, logps = list(prompt_ids), [], []
        finish: CompletionFinish = "length"
        for _ in range(sampling.max_new_tokens):
            with torch.no_grad():
                logits_V = self.model(torch.tensor([ids])).logits[0, -1].float()
            logits_V = logits_V / sampling.temperature
            if sampling.top_k:
                kth = torch.topk(logits_V, sampling.top_k).values[-1]
                logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
            logp_V = torch.log_softmax(logits_V, dim=-1)
            tok = int(torch.multinomial(logp_V.exp(), 1, generator=self._gen))
            ids.append(tok)
            out.append(tok)
            logps.append(float(logp_V[tok]))
            await asyncio.sleep(0)
            if tok == self.eos_id or tok in sampling.stop_token_ids:
                finish = "stop"
                break
        return Completion(tuple(out), tuple(logps), (self._version,) * len(out), finish)
