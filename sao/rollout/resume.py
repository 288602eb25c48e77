"""Continuing an episode across a checkpoint.

While an episode waits for a generation, its environment is idle between
turns: the tokens before that generation and the environment's
``state_dict()`` (:class:`~sao.types.RestorableEnv`) describe it exactly.
:data:`resume_points` keeps, per running episode, a way to take that
snapshot; a checkpoint stores it as an :class:`EpisodeResume`, and the
resumed run plays the episode on from there (only the current turn is
generated again). An episode caught anywhere else (in ``Env.step``,
tokenizing), or whose environment is not restorable, starts again from
scratch, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from sao.types import Message, Turn

__all__ = ["EpisodeResume", "ResumePoints", "resume_points"]


@dataclass(frozen=True)
class EpisodeResume:
    """An episode between turns: its history so far and its environment's state."""

    tokens: tuple[int, ...]
    action_mask: tuple[bool, ...]
    logp: tuple[float, ...]
    versions: tuple[int, ...]
    turns: tuple[Turn, ...]
    messages: tuple[Message, ...]
    env_state: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form (checkpoints)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EpisodeResume:
        return cls(
            tokens=tuple(d["tokens"]),
            action_mask=tuple(d["action_mask"]),
            logp=tuple(d["logp"]),
            versions=tuple(d["versions"]),
            turns=tuple(Turn(**t) for t in d["turns"]),
            messages=tuple(Message(**m) for m in d["messages"]),
            env_state=dict(d["env_state"]),
        )


class ResumePoints:
    """Episode key -> how to snapshot it, while it waits for a generation."""

    def __init__(self) -> None:
        self._live: dict[str, Callable[[], EpisodeResume]] = {}

    def offer(self, key: str, take: Callable[[], EpisodeResume]) -> None:
        """Episode ``key`` is between turns (generating): ``take()`` snapshots it."""
        self._live[key] = take

    def withdraw(self, key: str) -> None:
        """Episode ``key`` is busy again (or over): no snapshot until the next offer."""
        self._live.pop(key, None)

    def take(self, key: str) -> EpisodeResume | None:
        """The snapshot of ``key``, or None when it cannot be resumed now (its
        environment's ``state_dict`` failing counts as that)."""
        take = self._live.get(key)
        if take is None:
            return None
        try:
            return take()
        except Exception:  # an env whose state_dict breaks: restart it instead
            return None


resume_points = ResumePoints()
"""This process's running episodes."""
