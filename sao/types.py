"""The contracts every layer shares: messages, environment results, sampling
parameters, completions, trajectories, and their collation into ``[B, T]``
tensors.

Everything here is a frozen dataclass. Sequences are stored as tuples so a
``Trajectory`` is immutable once built, cheap to pickle (Ray, checkpoints) and
trivially JSON-serialisable. Collation (:func:`collate`) is the one place where
trajectories become padded tensors, following the position convention in
``ALGORITHMS.md``: entry ``t`` always describes token ``t``.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, runtime_checkable

import torch

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "env_error", "timeout", "error"]
"""Why an episode ended: the policy stopped (``stop``), a token or turn limit
was hit (``length``), the environment raised (``env_error``), an environment
call exceeded its deadline or blocked the event loop (``timeout``), or the
episode could not be played for another reason (``error``: the task's
``make_env`` raised, the first prompt does not fit the token budget, the
tokenizer failed, the engine failed)."""

CompletionFinish = Literal["stop", "length", "aborted"]
"""Why one generation call ended: a stop token or string (``stop``), the
``max_new_tokens`` / context limit (``length``), or it was cancelled
(``aborted``)."""

FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "env_error", "timeout", "error")
FAILURES: tuple[FinishReason, ...] = ("env_error", "timeout", "error")
"""Finish reasons of failed episodes: never trained as their score
(``rollout.failure_reward``)."""


@dataclass(frozen=True)
class Message:
    """One chat message, as passed to a tokenizer's ``apply_chat_template``."""

    role: Role
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


Observation = str | tuple[Message, ...] | tuple[int, ...]
"""What an environment shows the policy: plain text (sent as one ``user``
message), a tuple of chat messages (the first observation usually carries a
system and a user message), or raw token ids appended verbatim."""

Action = str
"""The policy's decoded reply for one turn; the sampled token ids themselves
are kept by the agent loop and never re-encoded."""


@dataclass(frozen=True)
class StepResult:
    """What ``Env.step`` returns.

    ``reward`` is an intermediate (per-turn) reward, usually 0; the episode's
    outcome reward comes from ``Env.score``, which the agent loop calls exactly
    once however the episode ended.
    """

    observation: Observation | None = None
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, float | int | str] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """An asynchronous, single-use environment (one object per episode).

    State lives in typed attributes of the implementing class, never in a
    shared dict. ``score`` is the one place the outcome reward is computed; the
    agent loop calls it once at the end of every episode, including episodes
    that ended by an error, a timeout or a length limit.
    """

    async def reset(self, seed: int) -> Observation: ...

    async def step(self, action: Action) -> StepResult: ...

    def score(self) -> float: ...


@runtime_checkable
class RestorableEnv(Protocol):
    """An environment whose state survives a checkpoint (optional), so a
    resumed run continues an episode that was in flight instead of starting
    it again.

    ``state_dict()`` is called between turns only: after ``reset``, or after
    a ``step`` whose observation the agent loop appended, and before the next
    reply. It returns JSON-serialisable data (str, numbers, bools, None,
    lists, dicts with str keys). ``load_state_dict(state)`` on a fresh
    environment of the same problem (``task.make_env(split, index)``, never
    reset) must make every later ``step`` and ``score`` behave exactly as
    they would have on the original.
    """

    def state_dict(self) -> dict[str, object]: ...

    def load_state_dict(self, state: Mapping[str, object]) -> None: ...


@dataclass(frozen=True)
class SamplingParams:
    """How the engine samples, recorded so the trainer can reproduce the
    sampling distribution (ALGORITHMS.md section 6).

    ``top_k = 0`` and ``top_p = 1.0`` disable those filters. The trainer
    applies ``temperature``; a ``top_p < 1`` or ``top_k > 0`` distribution is
    not reproducible by a plain forward pass, which :attr:`trainer_reproducible`
    reports.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 disables), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )

    @property
    def trainer_reproducible(self) -> bool:
        """True when a temperature-scaled forward pass reproduces the sampling
        distribution exactly (no top-p / top-k truncation)."""
        return self.top_p == 1.0 and self.top_k == 0


@dataclass(frozen=True)
class Completion:
    """One generation call's result: the sampled ids, the log-probability of
    each under the distribution actually sampled from, the weight version that
    sampled each token, and why generation stopped."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: CompletionFinish

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                "Completion fields must have equal lengths: "
                f"token_ids={n}, logprobs={len(self.logprobs)}, versions={len(self.versions)}"
            )


@dataclass(frozen=True)
class Turn:
    """One action segment of an episode and the observation that followed it.

    ``start``/``end`` index the action tokens in ``Trajectory.tokens``
    (``end`` exclusive); ``obs_end`` is the exclusive end of the following
    observation (``== end`` when there was none).
    """

    start: int
    end: int
    obs_end: int
    reward: float = 0.0
    env_latency_s: float = 0.0


@dataclass(frozen=True)
class Trajectory:
    """One finished episode, immutable once built (ARCHITECTURE.md contracts).

    Per-token fields have one entry per token of ``tokens``: ``rollout_logp``
    is 0.0 and ``versions`` is -1 outside actions. ``reward`` is the outcome
    reward from ``Env.score``; per-turn rewards live on the turns.
    """

    prompt_id: str
    tokens: tuple[int, ...]
    action_mask: tuple[bool, ...]
    rollout_logp: tuple[float, ...]
    versions: tuple[int, ...]
    turns: tuple[Turn, ...]
    reward: float
    finish_reason: FinishReason
    sampling: SamplingParams = field(default_factory=SamplingParams)
    group_id: str = ""
    error: str | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("action_mask", "rollout_logp", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Trajectory.{name} has {len(getattr(self, name))} entries, "
                    f"expected one per token ({n})"
                )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Trajectory.finish_reason must be one of {FINISH_REASONS}, "
                f"got {self.finish_reason!r}"
            )
        for turn in self.turns:
            if not (0 <= turn.start <= turn.end <= turn.obs_end <= n):
                raise ValueError(f"Trajectory turn {turn} is out of range for {n} tokens")

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def min_version(self) -> int:
        """Oldest weight version among the action tokens (-1 if none)."""
        vs = [v for v, m in zip(self.versions, self.action_mask, strict=True) if m]
        return min(vs) if vs else -1

    @property
    def total_reward(self) -> float:
        """Outcome reward plus every per-turn reward."""
        return self.reward + sum(t.reward for t in self.turns)

    @property
    def env_latency_s(self) -> float:
        return sum(t.env_latency_s for t in self.turns)

    @property
    def truncated(self) -> bool:
        """True when the episode was cut by a length limit (bootstrap candidate)."""
        return self.finish_reason == "length"


@dataclass(frozen=True)
class Batch:
    """Trajectories collated into padded ``[B, T]`` tensors (right padding).

    Shapes: every ``*_BT`` is ``[B, T]``; every ``*_B`` is ``[B]``.
    ``rewards_BT`` holds each turn's reward on that turn's last action token
    and the outcome reward added on the episode's last action token.
    ``turn_id_BT`` is the turn index of an action token and -1 elsewhere.
    """

    tokens_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    action_mask_BT: torch.Tensor
    rollout_logp_BT: torch.Tensor
    version_BT: torch.Tensor
    rewards_BT: torch.Tensor
    turn_id_BT: torch.Tensor
    rewards_B: torch.Tensor
    truncated_B: torch.Tensor
    prompt_ids: tuple[str, ...]
    group_ids: tuple[str, ...]

    @property
    def size(self) -> int:
        return int(self.tokens_BT.shape[0])

    def to(self, device: torch.device | str) -> Batch:
        """A copy with every tensor moved to ``device``."""
        changes: dict[str, object] = {
            k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)
        }
        return replace(self, **changes)  # type: ignore[arg-type]


def collate(trajectories: Sequence[Trajectory], *, pad_id: int = 0) -> Batch:
    """Pad trajectories on the right into a :class:`Batch`.

    The outcome reward (``Trajectory.reward``) sits on the last action token of
    each episode (ALGORITHMS.md notation); a row with no action token carries
    no reward position and contributes nothing to any loss.
    """
    if not trajectories:
        raise ValueError("collate needs at least one trajectory, got an empty sequence")
    B = len(trajectories)
    T = max(max(t.num_tokens for t in trajectories), 1)
    tokens_BT = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask_BT = torch.zeros((B, T), dtype=torch.bool)
    action_mask_BT = torch.zeros((B, T), dtype=torch.bool)
    rollout_logp_BT = torch.zeros((B, T), dtype=torch.float32)
    version_BT = torch.full((B, T), -1, dtype=torch.long)
    rewards_BT = torch.zeros((B, T), dtype=torch.float32)
    turn_id_BT = torch.full((B, T), -1, dtype=torch.long)
    for b, traj in enumerate(trajectories):
        n = traj.num_tokens
        tokens_BT[b, :n] = torch.tensor(traj.tokens, dtype=torch.long)
        attention_mask_BT[b, :n] = True
        mask = torch.tensor(traj.action_mask, dtype=torch.bool)
        action_mask_BT[b, :n] = mask
        rollout_logp_BT[b, :n] = torch.tensor(traj.rollout_logp, dtype=torch.float32)
        version_BT[b, :n] = torch.where(mask, torch.tensor(traj.versions), -1)
        for i, turn in enumerate(traj.turns):
            turn_id_BT[b, turn.start : turn.end] = i
            if turn.end > turn.start:
                rewards_BT[b, turn.end - 1] += turn.reward
        action_positions = mask.nonzero()
        if len(action_positions):
            rewards_BT[b, int(action_positions[-1])] += traj.reward
    return Batch(
        tokens_BT=tokens_BT,
        attention_mask_BT=attention_mask_BT,
        action_mask_BT=action_mask_BT,
        rollout_logp_BT=rollout_logp_BT,
        version_BT=version_BT,
        rewards_BT=rewards_BT,
        turn_id_BT=turn_id_BT.masked_fill(~action_mask_BT, -1),
        rewards_B=torch.tensor([t.total_reward for t in trajectories], dtype=torch.float32),
        truncated_B=torch.tensor([t.truncated for t in trajectories], dtype=torch.bool),
        prompt_ids=tuple(t.prompt_id for t in trajectories),
        group_ids=tuple(t.group_id or t.prompt_id for t in trajectories),
    )


def failed_trajectory(
    prompt_id: str, group_id: str, sampling: SamplingParams, reason: FinishReason, error: str
) -> Trajectory:
    """An episode that failed before its first token (e.g. ``make_env`` raised):
    no tokens, reward 0, never trained; it carries the reason and message."""
    return Trajectory(
        prompt_id=prompt_id,
        tokens=(),
        action_mask=(),
        rollout_logp=(),
        versions=(),
        turns=(),
        reward=0.0,
        finish_reason=reason,
        sampling=sampling,
        group_id=group_id,
        error=error,
    )


StepFn = Callable[[list[Trajectory], bool], Awaitable[dict[str, float]]]
"""The trainer's step as the loop calls it: trains on one batch (``train_actor``
False during critic warm-up) and returns its metrics."""
