"""The multi-turn agent loop: one environment, one engine, one trajectory.

``run_episode`` is token in, token out (ARCHITECTURE.md, contracts): the
prompt is tokenized once, every reply is kept as the exact sampled ids with
their log-probabilities and weight versions, and every later observation is
tokenized once and appended (:mod:`sao.rollout.chat` says how). The history
sent to ``engine.generate`` only ever grows, so each call's prompt is a prefix
of the next.

How an episode ends (``Trajectory.finish_reason``):

- ``stop``: ``env.step`` returned ``done=True``. Every reply goes to the
  environment, also one cut by ``max_new_tokens``: the environment decides
  whether a cut reply ends the episode.
- ``length``: ``max_turns`` replies were made, or the token budget
  (``max_total_tokens``, and the engine's ``max_seq_len`` when it has one) has
  no room for the next observation plus one generated token, or the engine
  aborted a generation; the environment was not done (a bootstrap candidate).
  An observation that does not fit is dropped.
- ``env_error``: ``env.reset`` / ``env.step`` / ``env.score`` raised, was not
  a coroutine, or returned something that is not an observation (text,
  messages, token ids), a :class:`~sao.types.StepResult` or a number.
- ``timeout``: ``env.reset`` or ``env.step`` exceeded its deadline.

``env.score()`` gives the outcome reward and is called exactly once at the end
of every episode, however it ended (whenever ``run_episode`` returns); if it
fails the reward is 0, the reason is in ``Trajectory.error`` and the finish
reason becomes ``env_error`` (unless the episode had already failed).

An environment's mistakes end only its own episode; the caller's mistakes (a
first prompt that does not fit the budget) and engine failures raise. A
timed-out environment call is cancelled and not waited for, so an environment
that ignores cancellation cannot stall the run (a synchronous, blocking call
inside an ``async def`` still blocks the event loop: keep blocking work in a
thread).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from sao.rollout.chat import (
    ObservationError,
    decode_reply,
    encode_first_observation,
    encode_next_observation,
    split_observation,
    validate_observation,
)
from sao.rollout.engine import Engine, episode_key
from sao.types import (
    Completion,
    Env,
    FinishReason,
    Message,
    SamplingParams,
    StepResult,
    Trajectory,
    Turn,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["EpisodeLimits", "run_episode"]


@dataclass(frozen=True)
class EpisodeLimits:
    """Per-episode limits of the agent loop.

    ``max_turns``: most assistant replies per episode. ``max_total_tokens``:
    most tokens in the whole trajectory (prompt, replies, observations); each
    generation asks for ``min(sampling.max_new_tokens, tokens left)``.
    ``step_timeout_s`` / ``reset_timeout_s``: deadline in seconds for one
    ``env.step`` / ``env.reset`` call; past it the episode ends with
    ``timeout``.
    """

    max_turns: int = 8
    max_total_tokens: int = 4096
    step_timeout_s: float = 60.0
    reset_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_total_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EpisodeLimits.{name} must be an int >= 1, got {value!r}")
        for name in ("step_timeout_s", "reset_timeout_s"):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (ok and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"EpisodeLimits.{name} must be a finite number of seconds > 0, got {value!r}"
                )


class _EnvFailure(Exception):
    """An environment call failed; ends the episode with ``reason``."""

    def __init__(self, reason: FinishReason, message: str) -> None:
        super().__init__(message)
        self.reason: FinishReason = reason
        self.message = message


def _describe(err: BaseException) -> str:
    """``Type: message (at file:line)`` of the innermost frame that raised."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


def _retrieve(task: asyncio.Future[object]) -> None:
    """Consume a cancelled env task's outcome so asyncio does not warn."""
    if not task.cancelled():
        task.exception()


async def _call_env(make: object, timeout_s: float, limit: str, where: str) -> object:
    """Await an env coroutine under a deadline; failures become :class:`_EnvFailure`.

    Uses ``asyncio.wait`` and cancels on timeout without waiting for the
    environment to unwind (``asyncio.wait_for`` would wait, and an environment
    that swallows the cancellation would then hang the run).
    """
    if not inspect.isawaitable(make):
        raise _EnvFailure("env_error", f"{where} must be async; it returned {type(make).__name__}")
    task = asyncio.ensure_future(make)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_retrieve)
        raise _EnvFailure("timeout", f"{where} exceeded EpisodeLimits.{limit}={timeout_s} s")
    if task.cancelled():
        raise _EnvFailure("env_error", f"{where} cancelled itself")
    err = task.exception()
    if err is not None:
        raise _EnvFailure("env_error", f"{where} raised {_describe(err)}")
    return task.result()


def _invoke(call: Callable[..., object], where: str, *args: object) -> object:
    """``call(*args)``, turning a synchronous raise into :class:`_EnvFailure`."""
    try:
        return call(*args)
    except Exception as err:
        raise _EnvFailure("env_error", f"{where} raised {_describe(err)}") from err


@dataclass
class _Episode:
    """The growing token history and what was recorded along it."""

    tokens: list[int] = field(default_factory=list)
    action_mask: list[bool] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    env_latency_s: float = 0.0
    gen_latency_s: float = 0.0

    def append(self, ids: list[int]) -> None:
        """Append non-action tokens (prompt or observation)."""
        self.tokens += ids
        self.action_mask += [False] * len(ids)
        self.logp += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def append_action(self, completion: Completion) -> None:
        self.tokens += completion.token_ids
        self.action_mask += [True] * len(completion.token_ids)
        self.logp += completion.logprobs
        self.versions += completion.versions

    def close_turn(self, start: int, end: int, reward: float, latency_s: float) -> None:
        """Record the turn whose action is ``tokens[start:end]``; its observation
        (if any) is everything appended after it so far."""
        self.turns.append(Turn(start, end, len(self.tokens), reward, latency_s))

    def extend_last_turn(self) -> None:
        last = self.turns[-1]
        self.turns[-1] = replace(last, obs_end=len(self.tokens))


def _context_window(engine: Engine) -> int | None:
    """The engine's ``max_seq_len`` (an optional attribute), if it has one."""
    context = getattr(engine, "max_seq_len", None)
    if isinstance(context, int) and not isinstance(context, bool) and context > 0:
        return context
    return None


def _check_result(result: object) -> StepResult:
    """``result`` if it is a usable :class:`StepResult`, else :class:`_EnvFailure`."""
    if not isinstance(result, StepResult):
        raise _EnvFailure("env_error", f"Env.step returned {type(result).__name__}, not StepResult")
    if not _finite_number(result.reward):
        raise _EnvFailure("env_error", f"Env.step returned reward {result.reward!r}, not a number")
    if not result.done and result.observation is None:
        raise _EnvFailure(
            "env_error", "Env.step returned done=False with no observation; return one or done=True"
        )
    return result


def _finite_number(value: object) -> bool:
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def _check_completion(completion: object, params: SamplingParams) -> Completion:
    """The engine's result, checked against what was asked (an engine bug raises)."""
    if not isinstance(completion, Completion):
        raise TypeError(f"Engine.generate returned {type(completion).__name__}, not Completion")
    if len(completion.token_ids) > params.max_new_tokens:
        raise RuntimeError(
            f"Engine.generate returned {len(completion.token_ids)} tokens for "
            f"max_new_tokens={params.max_new_tokens}"
        )
    return completion


async def _start(
    env: Env,
    tokenizer: PreTrainedTokenizerBase,
    limits: EpisodeLimits,
    context: int | None,
    ep: _Episode,
    seed: int,
) -> None:
    """Reset the environment and append the tokenized prompt to ``ep``."""
    budget = min(limits.max_total_tokens, context or limits.max_total_tokens)
    t0 = time.perf_counter()
    try:
        raw = await _call_env(
            _invoke(env.reset, "Env.reset", seed),
            limits.reset_timeout_s,
            "reset_timeout_s",
            "Env.reset",
        )
    finally:
        ep.env_latency_s += time.perf_counter() - t0
    try:
        obs = validate_observation(raw, vocab_size=len(tokenizer), where="Env.reset")
        ids, messages = encode_first_observation(tokenizer, obs)
    except ObservationError as err:
        raise _EnvFailure("env_error", str(err)) from err
    if not ids:
        raise _EnvFailure("env_error", f"Env.reset returned {raw!r:.80}, which is no token")
    if len(ids) >= budget:
        raise ValueError(
            f"the first prompt has {len(ids)} tokens but an episode may hold {budget} "
            f"(EpisodeLimits.max_total_tokens={limits.max_total_tokens}, engine max_seq_len="
            f"{context}), leaving no room to generate. "
            "Fix: raise max_total_tokens (and the engine's max_seq_len) or shorten the prompts"
        )
    ep.append(ids)
    ep.messages = messages


async def _generate(
    engine: Engine, sampling: SamplingParams, budget: int, ep: _Episode
) -> Completion:
    """One generation from the whole history; its tokens are appended as actions."""
    room = budget - len(ep.tokens)
    params = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room))
    t0 = time.perf_counter()
    completion = await engine.generate(tuple(ep.tokens), params)
    ep.gen_latency_s += time.perf_counter() - t0
    completion = _check_completion(completion, params)
    ep.append_action(completion)
    return completion


async def _respond(
    env: Env,
    tokenizer: PreTrainedTokenizerBase,
    limits: EpisodeLimits,
    ep: _Episode,
    completion: Completion,
) -> StepResult:
    """Hand the decoded reply to ``env.step``; record the turn (reward, latency)."""
    end = len(ep.tokens)
    start = end - len(completion.token_ids)
    text = decode_reply(tokenizer, completion.token_ids)
    t0 = time.perf_counter()
    reward = 0.0
    try:
        result = _check_result(
            await _call_env(
                _invoke(env.step, "Env.step", text),
                limits.step_timeout_s,
                "step_timeout_s",
                "Env.step",
            )
        )
        reward = float(result.reward)
    finally:
        latency = time.perf_counter() - t0
        ep.env_latency_s += latency
        ep.close_turn(start, end, reward, latency)
    ep.messages.append(Message("assistant", text))
    return result


def _observe(
    tokenizer: PreTrainedTokenizerBase,
    budget: int,
    ep: _Episode,
    completion: Completion,
    result: StepResult,
) -> bool:
    """Append the step's observation; False when it leaves no room to generate."""
    try:
        obs = validate_observation(result.observation, vocab_size=len(tokenizer), where="Env.step")
        history = ep.messages[:-1]  # without the reply just recorded
        ids = encode_next_observation(
            tokenizer, history, completion.token_ids, completion.finish_reason, obs
        )
    except ObservationError as err:
        raise _EnvFailure("env_error", str(err)) from err
    ep.messages += split_observation(obs)[1]
    if len(ep.tokens) + len(ids) >= budget:
        return False
    ep.append(ids)
    ep.extend_last_turn()
    return True


async def _play(
    env: Env,
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    sampling: SamplingParams,
    limits: EpisodeLimits,
    ep: _Episode,
    seed: int,
) -> tuple[FinishReason, str | None]:
    """Run the episode into ``ep``; the finish reason and error message."""
    context = _context_window(engine)
    budget = min(limits.max_total_tokens, context or limits.max_total_tokens)
    await _start(env, tokenizer, limits, context, ep, seed)
    for turn in range(limits.max_turns):
        completion = await _generate(engine, sampling, budget, ep)
        if completion.finish_reason == "aborted":
            start = len(ep.tokens) - len(completion.token_ids)
            ep.close_turn(start, len(ep.tokens), 0.0, 0.0)
            return "length", "the engine aborted the generation"
        result = await _respond(env, tokenizer, limits, ep, completion)
        if result.done:
            return "stop", None
        if turn == limits.max_turns - 1 or not _observe(tokenizer, budget, ep, completion, result):
            return "length", None
    return "length", None  # unreachable: max_turns >= 1


def _score(env: Env) -> tuple[float, str | None]:
    """``env.score()`` as a float, or 0.0 and the reason it failed."""
    try:
        value = env.score()
    except Exception as err:
        return 0.0, f"Env.score raised {_describe(err)}"
    if inspect.iscoroutine(value):
        value.close()
        return 0.0, "Env.score must be a plain method returning a float, not async"
    if not _finite_number(value):
        return 0.0, f"Env.score returned {value!r}, not a finite number"
    return float(value), None


async def run_episode(
    env: Env,
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    sampling: SamplingParams,
    limits: EpisodeLimits,
    *,
    seed: int,
    prompt_id: str,
    group_id: str = "",
) -> Trajectory:
    """Play one episode of ``env`` with ``engine`` and return its trajectory.

    Per-token fields have one entry per token ``[T]`` (prompt, replies,
    observations); ``action_mask`` marks the sampled ids. See the module
    docstring for the finish reasons. Raises ValueError when the first prompt
    does not fit the token budget; engine failures propagate.
    """
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if not isinstance(limits, EpisodeLimits):
        raise TypeError(f"limits must be an EpisodeLimits, got {type(limits).__name__}")
    ep = _Episode()
    key = episode_key.set(f"{prompt_id}#{group_id}#{seed}")
    try:
        reason, error = await _play(env, engine, tokenizer, sampling, limits, ep, seed)
    except _EnvFailure as failure:
        reason, error = failure.reason, failure.message
    finally:
        episode_key.reset(key)
    reward, score_error = _score(env)
    if score_error is not None:
        error = score_error if error is None else f"{error}; {score_error}"
        reason = "env_error" if reason in ("stop", "length") else reason
    metrics = {
        "num_turns": float(len(ep.turns)),
        "env_latency_s": ep.env_latency_s,
        "gen_latency_s": ep.gen_latency_s,
        "num_action_tokens": float(sum(ep.action_mask)),
        "num_tokens": float(len(ep.tokens)),
    }
    return Trajectory(
        prompt_id=prompt_id,
        tokens=tuple(ep.tokens),
        action_mask=tuple(ep.action_mask),
        rollout_logp=tuple(ep.logp),
        versions=tuple(ep.versions),
        turns=tuple(ep.turns),
        reward=reward,
        finish_reason=reason,
        sampling=sampling,
        group_id=group_id,
        error=error,
        metrics=metrics,
    )
