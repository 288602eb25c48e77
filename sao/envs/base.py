"""The task contract: a seeded generator of single-use environments with a
train split and a held-out split, plus imperfect demonstrations for
warm-starting tiny policies.

``Env``, ``StepResult`` and ``Message`` live in :mod:`sao.types` (the agent
loop in ``sao.rollout`` needs them and may not import ``sao.envs``); they are
re-exported here so environment authors import everything from one place.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

from sao.types import Action, Env, Message, Observation, RestorableEnv, StepResult

__all__ = [
    "Action",
    "Conversation",
    "Env",
    "Message",
    "Observation",
    "RestorableEnv",
    "Split",
    "StepAware",
    "StepResult",
    "Task",
]

Split = Literal["train", "eval"]
Conversation = tuple[Message, ...]
"""A whole chat: system/user/tool observations and assistant replies."""


@runtime_checkable
class Task(Protocol):
    """A family of problems and the environments that pose them.

    ``make_env(split, index)`` returns a fresh, single-use environment for
    problem ``index`` of ``split``; the problem is a pure function of
    ``(split, index)`` (and the task's own seed), so GRPO groups get the same
    problem by asking for the same index, and the held-out split never
    overlaps the train split. ``Env.reset(seed)`` seeds only the episode's own
    randomness.
    """

    name: str

    @property
    def eval_size(self) -> int:
        """Number of held-out problems (``make_env("eval", i)`` for ``i < eval_size``)."""
        ...

    def make_env(self, split: Split, index: int) -> Env: ...

    def demonstrations(self, n: int, *, seed: int) -> list[Conversation]:
        """``n`` imperfect demonstration conversations (some wrong or
        sub-optimal on purpose) for supervised warm-starting."""
        ...


@runtime_checkable
class StepAware(Protocol):
    """A task whose reward depends on training progress (e.g. ``style_shift``);
    the runtime calls ``set_train_step`` after every actor step."""

    def set_train_step(self, step: int) -> None: ...
