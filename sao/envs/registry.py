"""Built-in tasks by name: the one place names map to constructors (the config
edge). Modules are imported on first use so optional dependencies
(reasoning-gym, math-verify, datasets) are only needed by the tasks that use
them."""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from sao.envs.base import Task

_BUILTIN: dict[str, tuple[str, str]] = {
    "calculator": ("sao.envs.tiny.calculator", "CalculatorTask"),
    "guess_number": ("sao.envs.tiny.guess_number", "GuessNumberTask"),
    "reasoning_gym": ("sao.envs.qa.rgym", "ReasoningGymTask"),
    "style_shift": ("sao.envs.style.shift", "StyleShiftTask"),
    "dataset": ("sao.envs.qa.dataset", "DatasetTask"),
    "python_tool": ("sao.envs.tiny.python_tool", "PythonToolTask"),
    "swe": ("sao.envs.swe", "SweTask"),
}


def task_names() -> list[str]:
    """Names of the built-in tasks."""
    return sorted(_BUILTIN)


def make_task(name: str, **kwargs: Any) -> Task:
    """Build the built-in task ``name`` with keyword options.

    Raises ``ValueError`` for an unknown name, listing the valid ones and the
    closest match.
    """
    if name not in _BUILTIN:
        close = difflib.get_close_matches(name, list(_BUILTIN), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(task_names())}.{hint}")
    module_name, attr = _BUILTIN[name]
    cls = getattr(importlib.import_module(module_name), attr)
    task: Task = cls(**kwargs)
    return task
