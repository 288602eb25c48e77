"""Every built-in task's demonstrations, with default options and as its tiny
preset configures it: deterministic for a seed, faithful to the environment
(each conversation, replayed in a fresh env, gets the same observations) and
imperfect on purpose (some of them replay to a score below 1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sao.cli import TINY_PRESETS
from sao.config import PRESETS
from sao.envs.base import Conversation, Env, Split, Task
from sao.envs.registry import make_task, task_names
from sao.envs.style.shift import STYLES, StyleShiftEnv, StyleShiftTask
from tests.envs.conftest import replay

SIZES = {"python_tool": 24, "swe": 24}
"""Demonstrations per check (python_tool and swe run in the sandbox)."""


def build_task(name: str, variant: str, tmp_path: Path) -> Task:
    """Task ``name`` with default options, or with its tiny preset's options."""
    if name == "reasoning_gym":
        pytest.importorskip("reasoning_gym")
    if name == "dataset":
        rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(40)]
        path = tmp_path / "train.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return make_task("dataset", train_path=str(path), scorer="exact")
    options: dict[str, Any] = {}
    if variant == "tiny":
        options = dict(PRESETS[TINY_PRESETS[name]]["task"].get("options", {}))
    return make_task(name, **options)


def recorded(
    task: Task, n: int, seed: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Conversation], list[tuple[Split, int]]]:
    """Demonstrations and the ``(split, index)`` of the env each one was played in."""
    calls: list[tuple[Split, int]] = []
    make_env = task.make_env

    def recording(split: Split, index: int) -> Env:
        calls.append((split, index))
        return make_env(split, index)

    with monkeypatch.context() as m:
        m.setattr(task, "make_env", recording)
        demos = task.demonstrations(n, seed=seed)
    return demos, calls


def replayed_score(task: Task, conv: Conversation, where: tuple[Split, int] | None) -> float:
    """The demonstration's score when its replies are replayed in a fresh env.

    ``style_shift`` (whose reward depends on the preferred style) counts as
    correct when some style would accept it.
    """
    if isinstance(task, StyleShiftTask):
        topic = conv[-2].content.removeprefix("write about ")
        envs = [
            StyleShiftEnv(topic, s, judge=task.judge, max_turns=task.max_turns, system=task.system)
            for s in STYLES
        ]
        return max(replay(env, conv).score for env in envs)
    assert where is not None
    return replay(task.make_env(*where), conv).score


def tasks_and_variants() -> list[tuple[str, str]]:
    cases = [(name, "default") for name in task_names()]
    return cases + [(name, "tiny") for name in sorted(TINY_PRESETS)]


@pytest.mark.parametrize(("name", "variant"), tasks_and_variants())
def test_demonstrations_are_deterministic_faithful_and_imperfect(
    name: str, variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = build_task(name, variant, tmp_path)
    n = SIZES.get(name, 60)
    demos, calls = recorded(task, n, 3, monkeypatch)
    assert len(demos) == n
    assert demos == build_task(name, variant, tmp_path).demonstrations(n, seed=3)
    assert demos != task.demonstrations(n, seed=4)
    if not isinstance(task, StyleShiftTask):
        assert len(calls) == n and all(split == "train" for split, _ in calls)
    scores = [
        replayed_score(task, conv, calls[i] if calls else None) for i, conv in enumerate(demos)
    ]
    assert all(0.0 <= s <= 1.0 for s in scores)
    imperfect = sum(s < 1.0 for s in scores)
    assert 0 < imperfect < n, (name, variant, scores)


def test_every_task_with_a_warm_start_has_a_tiny_preset() -> None:
    assert set(TINY_PRESETS) == set(task_names()) - {"dataset"}
    for name, preset in TINY_PRESETS.items():
        assert PRESETS[preset]["task"]["name"] == name
