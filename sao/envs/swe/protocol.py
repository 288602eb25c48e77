"""The ``swe`` tool protocol: one tool call per reply, in the compact line
format a tiny policy learns from demonstrations, or as a Hermes tool call::

    ls [DIR]                      list the files (recursively)
    read PATH [START [END]]       show lines START..END, numbered
    replace PATH OLD => NEW       replace the one occurrence of OLD by NEW
    edit PATH START END           (then, on the next lines, the new text)
                                  replace lines START..END; no text deletes them
    run CMD                       run a shell command in the repository
    test                          run the problem's test command
    submit                        end the episode; the tests are graded

In ``replace`` the path ends at the first space or newline; OLD runs from
there to the first ``=>`` with a space or newline on each side (each side's
one whitespace character is part of the separator), NEW is the rest of the
reply, so both may span lines. ``run`` takes the rest of the reply (several
lines allowed). The Hermes form, for chat models, names the same tools and
arguments: ``<tool_call>{"name": "replace", "arguments": {"path": "calc.py",
"old": "a - b", "new": "a + b"}}</tool_call>`` (``read``: ``path``,
``start``, ``end``; ``edit``: ``path``, ``start``, ``end``, ``text``;
``run``: ``command`` and optionally ``timeout`` in seconds).
"""

from __future__ import annotations

import re

from sao.envs._tools import JsonArg, ToolCall, ToolCallError, parse_hermes

__all__ = ["FORMAT", "USAGE", "parse_call"]

USAGE = {
    "ls": "ls [DIR]",
    "read": "read PATH [START [END]]",
    "replace": "replace PATH OLD => NEW",
    "edit": "edit PATH START END, then the new lines",
    "run": "run CMD",
    "test": "test",
    "submit": "submit",
}
"""The line form of each tool, shown in error observations."""
FORMAT = "tools: " + " | ".join(USAGE.values())
_ARGS: dict[str, dict[str, type]] = {
    "ls": {"path": str},
    "read": {"path": str, "start": int, "end": int},
    "replace": {"path": str, "old": str, "new": str},
    "edit": {"path": str, "start": int, "end": int, "text": str},
    "run": {"command": str, "timeout": float},
    "test": {},
    "submit": {},
}
_REQUIRED = {"read": ("path",), "replace": ("path", "old", "new"), "run": ("command",)}
_REQUIRED["edit"] = ("path", "start", "end")
_SEPARATOR = re.compile(r"\s=>\s")
_HEAD = re.compile(r"(\S+)\s?(.*)\Z", re.DOTALL)
"""A first word, one whitespace character, the rest."""


def _bad(name: str, what: str) -> ToolCallError:
    return ToolCallError(f"error: {what}; format: {USAGE[name]}")


def parse_call(reply: str) -> ToolCall:
    """The tool call in ``reply``; raises :class:`ToolCallError` with the
    observation that says what is wrong and the correct format."""
    hermes = parse_hermes(reply)
    call = hermes if hermes is not None else _parse_line(reply)
    if call.name not in _ARGS:
        raise ToolCallError(f"error: unknown tool {call.name[:20]!r}; {FORMAT}")
    _check_args(call)
    return call


def _check_args(call: ToolCall) -> None:
    """Raise unless ``call`` has every required argument, each of its type."""
    spec = _ARGS[call.name]
    for key, value in call.arguments.items():
        kind = spec.get(key)
        if kind is None:
            raise _bad(call.name, f"{call.name} takes no argument {key[:20]!r}")
        number = isinstance(value, int | float) and not isinstance(value, bool)
        ok = isinstance(value, str) if kind is str else number
        if kind is int and ok:
            ok = float(value).is_integer()  # type: ignore[arg-type]
        if not ok:
            raise _bad(call.name, f"{key} must be {'text' if kind is str else 'a number'}")
    missing = [k for k in _REQUIRED.get(call.name, ()) if k not in call.arguments]
    if missing:
        raise _bad(call.name, f"{call.name} needs {', '.join(missing)}")


def _parse_line(reply: str) -> ToolCall:
    """A reply in the line format (see the module docstring)."""
    m = _HEAD.match(reply.strip())
    if m is None:
        raise ToolCallError(f"error: empty reply; {FORMAT}")
    name, rest = m.group(1).lower(), m.group(2)
    first, _, body = rest.partition("\n")
    words = first.split()
    args: dict[str, JsonArg] = {}
    if name in ("test", "submit"):
        if rest.strip():
            raise _bad(name, f"{name} takes no arguments")
    elif name == "ls":
        if len(words) > 1:
            raise _bad(name, "ls takes at most one directory")
        args = {"path": words[0]} if words else {}
    elif name == "read":
        args = _path_and_numbers(name, words, at_most=2)
    elif name == "edit":
        args = {**_path_and_numbers(name, words, at_most=2), "text": body}
        if len(words) != 3:
            raise _bad(name, "edit needs a path and two line numbers")
    elif name == "replace":
        args = _replace_args(rest)
    elif name == "run":
        if not rest.strip():
            raise _bad(name, "run needs a command")
        args = {"command": rest}
    return ToolCall(name, args)


def _path_and_numbers(name: str, words: list[str], *, at_most: int) -> dict[str, JsonArg]:
    """``PATH [N [M]]`` as ``path``, ``start``, ``end``."""
    if not words:
        raise _bad(name, f"{name} needs a path")
    if len(words) > 1 + at_most or not all(w.isdigit() for w in words[1:]):
        raise _bad(name, "line numbers must be whole numbers")
    args: dict[str, JsonArg] = {"path": words[0]}
    for key, word in zip(("start", "end"), words[1:], strict=False):
        args[key] = int(word)
    return args


def _replace_args(rest: str) -> dict[str, JsonArg]:
    """``PATH OLD => NEW`` as ``path``, ``old``, ``new``."""
    head = _HEAD.match(rest)
    if head is None or not head.group(2):
        raise _bad("replace", "replace needs a path, the old text, => and the new text")
    path, tail = head.group(1), head.group(2)
    m = _SEPARATOR.search(tail)
    if m is None:
        raise _bad("replace", "no ' => ' between the old and the new text")
    return {"path": path, "old": tail[: m.start()], "new": tail[m.end() :]}
