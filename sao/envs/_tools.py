"""Pieces every tool-using environment shares: the opening messages, reading
a tool call out of a reply, cutting an observation with a marker, and
replaying scripted actions through an environment's synchronous step into a
demonstration :data:`~sao.envs.base.Conversation`.

Two call formats are read here. The line format of the built-in tiny tasks
(``calc 3*4``, ``guess 16``, ``read calc.py 1 9``) is a keyword and its
argument text; an environment reads its keywords with its own pattern,
usually on :func:`last_line` of the reply. The Hermes format of chat models
is ``<tool_call>{"name": "read", "arguments": {"path": "a.py"}}</tool_call>``
(:func:`parse_hermes`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sao.types import Message, Observation, StepResult

__all__ = [
    "ToolCall",
    "ToolCallError",
    "Transcript",
    "as_observation",
    "clip",
    "last_line",
    "opening",
    "parse_hermes",
    "replay",
]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)

JsonArg = str | int | float | bool | None


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call: the tool's name and its arguments."""

    name: str
    arguments: Mapping[str, JsonArg] = field(default_factory=dict)


class ToolCallError(ValueError):
    """A reply that tries to call a tool but cannot be read; the message,
    shown to the policy, says what is wrong."""


def opening(prompt: str, system_prompt: str | None) -> list[Message]:
    """The first messages of an episode: ``prompt`` as a user message, after
    ``system_prompt`` as a system message when one is given."""
    user = Message("user", prompt)
    return [Message("system", system_prompt), user] if system_prompt else [user]


def as_observation(messages: Sequence[Message]) -> Observation:
    """What ``reset`` returns for ``messages``: the text of a lone user
    message, else the messages themselves."""
    if len(messages) == 1 and messages[0].role == "user":
        return messages[0].content
    return tuple(messages)


def last_line(text: str) -> str:
    """The last non-empty line of ``text``, stripped ("" when there is none):
    the line the single-line tools read when a reply spans several."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def parse_hermes(text: str) -> ToolCall | None:
    """The first ``<tool_call>{...}</tool_call>`` of ``text``, or None when the
    reply has none. Raises :class:`ToolCallError` for a call whose body is not
    a JSON object with a string ``name`` and an object of plain values as
    ``arguments`` (which may be left out)."""
    m = _HERMES.search(text)
    if m is None:
        return None
    try:
        body = json.loads(m.group(1))
    except json.JSONDecodeError as err:
        raise ToolCallError(f"the tool call is not valid JSON ({err.msg})") from None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        raise ToolCallError('the tool call needs a "name" string')
    args = body.get("arguments", {})
    if isinstance(args, str):  # some chat templates send the arguments JSON-encoded
        try:
            args = json.loads(args)
        except ValueError:
            raise ToolCallError('"arguments" is a string that is not JSON') from None
    if not isinstance(args, dict) or any(isinstance(v, list | dict) for v in args.values()):
        raise ToolCallError('"arguments" must be an object of strings and numbers')
    return ToolCall(body["name"], args)


def clip(text: str, limit: int, marker: str = "...") -> str:
    """``text`` cut to ``limit`` characters, ending in ``marker`` when cut."""
    if len(text) <= limit:
        return text
    return text[: max(limit - len(marker), 0)] + marker


class Transcript:
    """A demonstration being recorded: the opening messages, then each
    scripted action and the observation it got (sent with role ``user``, as
    the built-in environments send feedback)."""

    def __init__(self, first: Iterable[Message]) -> None:
        self.messages: list[Message] = list(first)

    def record(self, action: str, observation: str | None) -> None:
        """Append ``action`` and, unless it is None, the observation it got."""
        self.messages.append(Message("assistant", action))
        if observation is not None:
            self.messages.append(Message("user", observation))

    def play(self, act: Callable[[str], StepResult], action: str) -> StepResult:
        """Apply ``action`` with the environment's synchronous step ``act`` and
        record it with its text observation (none once the episode is done)."""
        result = act(action)
        obs = result.observation
        self.record(action, obs if isinstance(obs, str) and not result.done else None)
        return result

    def conversation(self) -> tuple[Message, ...]:
        """The recorded demonstration."""
        return tuple(self.messages)


def replay(
    first: Iterable[Message], actions: Iterable[str], act: Callable[[str], StepResult]
) -> tuple[Message, ...]:
    """A demonstration: ``actions`` played in order through ``act`` until the
    episode is done, each followed by its observation."""
    transcript = Transcript(first)
    for action in actions:
        if transcript.play(act, action).done:
            break
    return transcript.conversation()
