"""Typed reading of environment state dicts (``RestorableEnv.load_state_dict``).

A state dict comes back from a checkpoint as plain JSON data, so every field
is checked before it becomes a typed attribute again: a damaged or foreign
state fails at load time, naming the field, instead of surfacing later as a
wrong reward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

__all__ = ["expect_same", "read", "read_list", "read_optional"]

T = TypeVar("T")


def _check(key: str, value: object, kind: type[T]) -> T:
    """``value`` as a ``kind``: an int counts as a float (JSON writes ``1.0``
    back as ``1.0``, but a hand-made state may say ``1``); a bool is no int."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ValueError(f"env state {key!r}: expected {kind.__name__}, got {value!r:.80}")
    return value


def read(state: Mapping[str, object], key: str, kind: type[T]) -> T:
    """``state[key]``, checked to be a ``kind``."""
    if key not in state:
        raise ValueError(f"env state has no {key!r} (keys: {sorted(state)})")
    return _check(key, state[key], kind)


def read_optional(state: Mapping[str, object], key: str, kind: type[T]) -> T | None:
    """``state[key]``, checked to be a ``kind`` or None."""
    if key not in state:
        raise ValueError(f"env state has no {key!r} (keys: {sorted(state)})")
    value = state[key]
    return None if value is None else _check(key, value, kind)


def read_list(state: Mapping[str, object], key: str, kind: type[T]) -> list[T]:
    """``state[key]``, checked to be a list of ``kind``."""
    return [_check(key, item, kind) for item in read(state, key, list)]


def expect_same(state: Mapping[str, object], key: str, expected: object) -> None:
    """Raise unless ``state[key] == expected``: a state only loads into an env
    of the problem it was taken from."""
    if state.get(key) != expected:
        raise ValueError(
            f"env state is for {key} {state.get(key)!r:.80}, but this env has {expected!r:.80}; "
            "load it into task.make_env(split, index) of the same problem"
        )
