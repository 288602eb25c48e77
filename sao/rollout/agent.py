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
- ``timeout``: ``env.reset`` or ``env.step`` exceeded its deadline, or held
  the event loop longer than it (:mod:`sao.rollout.envcall`). An environment
  class that held the loop runs in worker threads from then on
  (:mod:`sao.rollout.envthread`).
- ``error``: the episode could not be played: the first prompt does not fit
  the token budget, or the tokenizer failed on an observation.

``env.score()`` gives the outcome reward and is called exactly once at the end
of every episode, however it ended (whenever ``run_episode`` returns); if it
fails the reward is 0, the reason is in ``Trajectory.error`` and the finish
reason becomes ``env_error`` (unless the episode had already failed).

An environment's mistakes, a prompt that does not fit and a tokenizer
failure end only their own episode (the reason is in ``Trajectory.error``);
engine failures raise (the runtime decides, see the orchestrator). A
timed-out environment call is cancelled and not waited for, so an environment
that ignores cancellation cannot stall the run. Observations are capped at
``EpisodeLimits.max_observation_tokens`` (cut with a marker, counted in
``Trajectory.metrics["observations_truncated"]``), and all tokenization runs
in one worker thread, off the event loop. An episode that ends ``stop`` or
``length`` is then checked token for token against the engine's generate
calls and the chat template (:mod:`sao.rollout.tito`, ``EpisodeLimits.tito_check``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from sao.rollout.chat import (
    ObservationError,
    cap_observation,
    decode_reply,
    encode_first_observation,
    encode_next_observation,
    split_observation,
    validate_observation,
)
from sao.rollout.engine import Engine, episode_key
from sao.rollout.envcall import (
    EpisodeFailure,
    check_result,
    describe_error,
    finite_number,
    score_env,
)
from sao.rollout.envthread import EnvCalls
from sao.rollout.progress import progress
from sao.rollout.resume import EpisodeResume, resume_points
from sao.rollout.tito import TITO_POLICIES, GenerationLog, TitoPolicy, check_episode, judge
from sao.types import (
    Completion,
    Env,
    FinishReason,
    Message,
    Observation,
    RestorableEnv,
    SamplingParams,
    StepResult,
    Trajectory,
    Turn,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["EpisodeLimits", "run_episode"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class EpisodeLimits:
    """Per-episode limits of the agent loop.

    ``max_turns``: most assistant replies per episode. ``max_total_tokens``:
    most tokens in the whole trajectory (prompt, replies, observations); each
    generation asks for ``min(sampling.max_new_tokens, tokens left)``.
    ``step_timeout_s`` / ``reset_timeout_s``: deadline in seconds for one
    ``env.step`` / ``env.reset`` call; past it the episode ends with
    ``timeout``. ``max_observation_tokens``: most tokens of one later
    observation's content (None: no cap). ``tito_check``: what a trajectory
    that fails the token-in/token-out check becomes (:mod:`sao.rollout.tito`).
    """

    max_turns: int = 8
    max_total_tokens: int = 4096
    step_timeout_s: float = 60.0
    reset_timeout_s: float = 60.0
    max_observation_tokens: int | None = None
    tito_check: TitoPolicy = "warn"

    def __post_init__(self) -> None:
        if self.tito_check not in TITO_POLICIES:
            raise ValueError(
                f"EpisodeLimits.tito_check must be one of {TITO_POLICIES}, got {self.tito_check!r}"
            )
        for name in ("max_turns", "max_total_tokens", "max_observation_tokens"):
            value = getattr(self, name)
            if name == "max_observation_tokens" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EpisodeLimits.{name} must be an int >= 1, got {value!r}")
        for name in ("step_timeout_s", "reset_timeout_s"):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (ok and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"EpisodeLimits.{name} must be a finite number of seconds > 0, got {value!r}"
                )


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
    truncated: int = 0
    """Observations cut to ``max_observation_tokens``."""
    reported: dict[str, float] = field(default_factory=dict)
    """The environment's own numbers: ``StepResult.info`` entries named ``metric/...``."""

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


_TOKENIZER_THREAD = ThreadPoolExecutor(1, thread_name_prefix="sao-tokenize")
"""Tokenization runs here, off the event loop, one call at a time."""


async def _off_loop(where: str, fn: Callable[[], _T]) -> _T:
    """``fn()`` in the tokenizer thread; an :class:`ObservationError` becomes
    ``env_error``, any other failure ``error`` (the tokenizer or template broke)."""
    try:
        return await asyncio.get_running_loop().run_in_executor(_TOKENIZER_THREAD, fn)
    except ObservationError as err:
        raise EpisodeFailure("env_error", str(err)) from err
    except Exception as err:
        raise EpisodeFailure("error", f"tokenizing {where} failed: {describe_error(err)}") from err


async def _start(
    calls: EnvCalls,
    tokenizer: PreTrainedTokenizerBase,
    limits: EpisodeLimits,
    context: int | None,
    ep: _Episode,
    seed: int,
) -> None:
    """Reset the environment and append the tokenized prompt to ``ep``."""
    budget = min(limits.max_total_tokens, context or limits.max_total_tokens)
    progress.enter("Env.reset")
    t0 = time.perf_counter()
    try:
        raw = await calls.reset(seed, limits.reset_timeout_s)
    finally:
        ep.env_latency_s += time.perf_counter() - t0
    progress.enter("tokenizing the prompt")

    def encode() -> tuple[list[int], list[Message]]:
        obs = validate_observation(raw, vocab_size=len(tokenizer), where="Env.reset")
        return encode_first_observation(tokenizer, obs)

    ids, messages = await _off_loop("the prompt", encode)
    if not ids:
        raise EpisodeFailure("env_error", f"Env.reset returned {raw!r:.80}, which is no token")
    if len(ids) >= budget:
        raise EpisodeFailure(
            "error",
            f"the first prompt has {len(ids)} tokens but an episode may hold {budget} "
            f"(rollout.max_total_tokens={limits.max_total_tokens}, engine max_seq_len="
            f"{context}), leaving no room to generate. "
            "Fix: raise max_total_tokens (and the engine's max_seq_len) or shorten the prompts",
        )
    ep.append(ids)
    ep.messages = messages


async def _generate(
    engine: Engine, sampling: SamplingParams, budget: int, ep: _Episode
) -> Completion:
    """One generation from the whole history; its tokens are appended as actions."""
    room = budget - len(ep.tokens)
    params = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room))
    progress.enter(f"generating turn {len(ep.turns) + 1} ({len(ep.tokens)} tokens of history)")
    t0 = time.perf_counter()
    completion = await engine.generate(tuple(ep.tokens), params)
    ep.gen_latency_s += time.perf_counter() - t0
    completion = _check_completion(completion, params)
    ep.append_action(completion)
    return completion


async def _respond(
    calls: EnvCalls,
    tokenizer: PreTrainedTokenizerBase,
    limits: EpisodeLimits,
    ep: _Episode,
    completion: Completion,
) -> StepResult:
    """Hand the decoded reply to ``env.step``; record the turn (reward, latency)."""
    end = len(ep.tokens)
    start = end - len(completion.token_ids)
    text = decode_reply(tokenizer, completion.token_ids)
    progress.enter(f"Env.step of turn {len(ep.turns) + 1}")
    t0 = time.perf_counter()
    reward = 0.0
    try:
        result = check_result(await calls.step(text, limits.step_timeout_s))
        reward = float(result.reward)
        ep.reported |= {
            k: float(v)
            for k, v in result.info.items()
            if k.startswith("metric/") and finite_number(v)
        }
    finally:
        latency = time.perf_counter() - t0
        ep.env_latency_s += latency
        ep.close_turn(start, end, reward, latency)
    ep.messages.append(Message("assistant", text))
    return result


async def _observe(
    tokenizer: PreTrainedTokenizerBase,
    limits: EpisodeLimits,
    budget: int,
    ep: _Episode,
    completion: Completion,
    result: StepResult,
) -> bool:
    """Append the step's observation (capped); False when it leaves no room to generate."""
    progress.enter(f"tokenizing the observation of turn {len(ep.turns)}")
    cap = limits.max_observation_tokens

    def encode() -> tuple[Observation, int, list[int]]:
        obs = validate_observation(result.observation, vocab_size=len(tokenizer), where="Env.step")
        obs, cut = cap_observation(tokenizer, obs, cap) if cap is not None else (obs, 0)
        history = ep.messages[:-1]  # without the reply just recorded
        ids = encode_next_observation(
            tokenizer, history, completion.token_ids, completion.finish_reason, obs
        )
        return obs, cut, ids

    obs, cut, ids = await _off_loop("an observation", encode)
    ep.truncated += cut > 0
    ep.messages += split_observation(obs)[1]
    if len(ep.tokens) + len(ids) >= budget:
        return False
    ep.append(ids)
    ep.extend_last_turn()
    return True


def _offer_resume(env: Env, ep: _Episode) -> None:
    """Between turns: let a checkpoint snapshot this episode (restorable envs)."""
    key = episode_key.get()
    if key is None or not isinstance(env, RestorableEnv):
        return
    n, k, m = len(ep.tokens), len(ep.turns), len(ep.messages)

    def take() -> EpisodeResume:
        return EpisodeResume(
            tokens=tuple(ep.tokens[:n]),
            action_mask=tuple(ep.action_mask[:n]),
            logp=tuple(ep.logp[:n]),
            versions=tuple(ep.versions[:n]),
            turns=tuple(ep.turns[:k]),
            messages=tuple(ep.messages[:m]),
            env_state=env.state_dict(),
        )

    resume_points.offer(key, take)


def _resumed(resume: EpisodeResume) -> _Episode:
    return _Episode(
        tokens=list(resume.tokens),
        action_mask=list(resume.action_mask),
        logp=list(resume.logp),
        versions=list(resume.versions),
        turns=list(resume.turns),
        messages=list(resume.messages),
    )


async def _play(
    calls: EnvCalls,
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    sampling: SamplingParams,
    limits: EpisodeLimits,
    ep: _Episode,
    seed: int,
    resumed: bool,
) -> tuple[FinishReason, str | None]:
    """Run the episode into ``ep`` (from its start, or on from a resumed
    history); the finish reason and error message."""
    context = _context_window(engine)
    budget = min(limits.max_total_tokens, context or limits.max_total_tokens)
    env = calls.env
    if not resumed:
        await _start(calls, tokenizer, limits, context, ep, seed)
    for turn in range(len(ep.turns), limits.max_turns):
        _offer_resume(env, ep)
        try:
            completion = await _generate(engine, sampling, budget, ep)
        finally:
            resume_points.withdraw(episode_key.get() or "")
        if completion.finish_reason == "aborted":
            start = len(ep.tokens) - len(completion.token_ids)
            ep.close_turn(start, len(ep.tokens), 0.0, 0.0)
            return "length", "the engine aborted the generation"
        result = await _respond(calls, tokenizer, limits, ep, completion)
        if result.done:
            return "stop", None
        if turn == limits.max_turns - 1:
            return "length", None
        if not await _observe(tokenizer, limits, budget, ep, completion, result):
            return "length", None
    return "length", None  # only a resumed history already at max_turns gets here


async def _checked(
    traj: Trajectory,
    tokenizer: PreTrainedTokenizerBase,
    ep: _Episode,
    log: GenerationLog,
    limits: EpisodeLimits,
    resumed: bool,
) -> Trajectory:
    """``traj`` after the token-in/token-out check (:mod:`sao.rollout.tito`, in
    the tokenizer thread), for an episode that would be trained."""
    if traj.finish_reason not in ("stop", "length") or not traj.turns:
        return traj
    messages, generations = list(ep.messages), list(log.generations)
    check = partial(check_episode, tokenizer, traj, messages, generations, complete=not resumed)
    return judge(traj, await _off_loop("the tito check", check), limits.tito_check)


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
    resume: EpisodeResume | None = None,
) -> Trajectory:
    """Play one episode of ``env`` with ``engine`` and return its trajectory.

    Per-token fields have one entry per token ``[T]`` (prompt, replies,
    observations); ``action_mask`` marks the sampled ids. See the module
    docstring for the finish reasons. Engine failures propagate. ``resume``
    continues a checkpointed episode (:mod:`sao.rollout.resume`): ``env``
    must already hold its state (``load_state_dict``) and is not reset.
    """
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if not isinstance(limits, EpisodeLimits):
        raise TypeError(f"limits must be an EpisodeLimits, got {type(limits).__name__}")
    ep = _Episode() if resume is None else _resumed(resume)
    log = GenerationLog(engine) if limits.tito_check != "off" else None
    name = f"{prompt_id}#{group_id}#{seed}"
    key = episode_key.set(name)
    calls = EnvCalls(env)
    try:
        resumed = resume is not None
        reason, error = await _play(
            calls, log or engine, tokenizer, sampling, limits, ep, seed, resumed
        )
    except EpisodeFailure as failure:
        reason, error = failure.reason, failure.message
    finally:
        calls.close()
        episode_key.reset(key)
        progress.end(name)
    reward, score_error = score_env(env)
    if score_error is not None:
        error = score_error if error is None else f"{error}; {score_error}"
        reason = "env_error" if reason in ("stop", "length") else reason
    traj = _trajectory(ep, prompt_id, group_id, sampling, reward, reason, error)
    return traj if log is None else await _checked(traj, tokenizer, ep, log, limits, resumed)


def _trajectory(
    ep: _Episode,
    prompt_id: str,
    group_id: str,
    sampling: SamplingParams,
    reward: float,
    reason: FinishReason,
    error: str | None,
) -> Trajectory:
    """The finished episode ``ep`` as a :class:`Trajectory`, with its metrics."""
    metrics = {
        "num_turns": float(len(ep.turns)),
        "env_latency_s": ep.env_latency_s,
        "gen_latency_s": ep.gen_latency_s,
        "num_action_tokens": float(sum(ep.action_mask)),
        "num_tokens": float(len(ep.tokens)),
        "observations_truncated": float(ep.truncated),
        **ep.reported,
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
