"""RestorableEnv: every built-in env's state survives a JSON round trip into a
fresh env of the same problem (``task.make_env(split, index)``, never reset),
which then plays on exactly as the original: same StepResults, same score."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sao.envs.base import Env, Observation, RestorableEnv, Split, StepResult, Task
from sao.envs.latency import LatencyEnv, LatencyWrapper, RestorableLatencyEnv
from sao.envs.qa.dataset import DatasetTask
from sao.envs.style.shift import StyleShiftTask
from sao.envs.swe import SweTask
from sao.envs.tiny.calculator import CalculatorTask, solve_steps
from sao.envs.tiny.guess_number import GuessNumberTask
from sao.envs.tiny.python_tool import PythonToolTask

Actions = Callable[[Env], list[str]]
"""The scripted replies for one env (they may depend on its problem)."""


async def no_sleep(delay: float) -> None:
    """Stands in for ``asyncio.sleep`` so latency tests take no time."""


def roundtrip(state: dict[str, object]) -> dict[str, object]:
    """``state`` through strict JSON, as a checkpoint stores it."""
    loaded: dict[str, object] = json.loads(json.dumps(state, allow_nan=False))
    return loaded


def restorable(env: object) -> RestorableEnv:
    """``env``, asserted to be a ``RestorableEnv``."""
    assert isinstance(env, RestorableEnv), type(env).__name__
    return env


async def _check_resume(
    task: Task, split: Split, index: int, actions: Sequence[str], cut: int
) -> list[StepResult]:
    """Play ``actions[:cut]`` (stopping at done), restore a fresh env from the
    state, play the rest on both and assert they agree; returns the original's results."""
    original = task.make_env(split, index)
    await original.reset(seed=7)
    results = []
    for action in actions[:cut]:
        results.append(await original.step(action))
        if results[-1].done:
            break
    state = restorable(original).state_dict()
    assert roundtrip(state) == state
    restored = task.make_env(split, index)
    restorable(restored).load_state_dict(roundtrip(state))
    assert restorable(restored).state_dict() == state
    for action in actions[cut:]:
        result = await original.step(action)
        assert await restored.step(action) == result, action
        results.append(result)
    assert restored.score() == original.score()
    assert restorable(restored).state_dict() == restorable(original).state_dict()
    return results


def check_resume(
    task: Task, split: Split, index: int, actions: Sequence[str], cut: int
) -> list[StepResult]:
    """Synchronous :func:`_check_resume`."""
    return asyncio.run(_check_resume(task, split, index, actions, cut))


def calc_actions(env: Env) -> list[str]:
    """Early answer, junk, a bad call, the solution's calls, the answer."""
    steps = solve_steps(env.problem)  # type: ignore[attr-defined]
    junk = ["answer 5", "hello", "calc 1+"]
    return [*junk, *(f"calc {e}" for e, _ in steps), f"answer {steps[-1][1]}"]


def guess_actions(env: Env) -> list[str]:
    """Valid, out-of-range and malformed guesses, then the number."""
    return ["guess 16", "guess 99", "guess?", "guess 8", f"guess {env.target}"]  # type: ignore[attr-defined]


def dataset_answer(env: Env) -> list[str]:
    """One reply: the reference answer."""
    return [f"answer {env.example.answer}"]  # type: ignore[attr-defined]


def rgym_answer(env: Env) -> list[str]:
    """One reply: the entry's answer."""
    return [f"answer {env.entry['answer']}"]  # type: ignore[attr-defined]


def style_actions(env: Env) -> list[str]:
    """An untagged text (a format hint), then a tagged cute one."""
    topic = env.topic  # type: ignore[attr-defined]
    return [f"{topic} are nice", f"[cute] {topic} are so fluffy and smol, yay!"]


def python_actions(env: Env) -> list[str]:
    """Junk, a crashing program, an empty one, the reference program, its answer."""
    problem = env.problem  # type: ignore[attr-defined]
    return ["hm", "run print(1+)", "run ", f"run {problem.code}", f"answer {problem.answer}"]


def swe_actions(env: Env) -> list[str]:
    """Junk, a read, a miscopied and then the right replacement, submit."""
    task = SweTask(seed=4)
    bug = task.bug("train", 0)
    path = bug.module
    fix = f"replace {path} {bug.old} => {bug.new}"
    return ["hm", f"read {path}", f"replace {path} nowhere => x", fix, "submit"]


def dataset_task(tmp_path: Path) -> Task:
    rows = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(6)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DatasetTask(path, scorer="exact", eval_fraction=0.5, seed=3)


def rgym_task(tmp_path: Path) -> Task:
    pytest.importorskip("reasoning_gym")
    from sao.envs.qa.rgym import ReasoningGymTask

    return ReasoningGymTask("basic_arithmetic", train_size=20, eval_size=3)


@dataclass(frozen=True)
class Case:
    """One env to restore: its task, a problem, scripted replies and where to cut."""

    make_task: Callable[[Path], Task]
    actions: Actions
    cut: int
    split: Split = "train"
    index: int = 0


def calc(_: Path) -> Task:
    return CalculatorTask(seed=1, max_turns=9, max_calls=6)


CASES = {
    "calculator": Case(calc, calc_actions, cut=3),
    "calculator_eval": Case(calc, calc_actions, cut=4, split="eval", index=2),
    "guess_number": Case(lambda _: GuessNumberTask(seed=2), guess_actions, cut=3),
    "dataset": Case(dataset_task, dataset_answer, cut=0),
    "reasoning_gym": Case(rgym_task, rgym_answer, cut=0, split="eval", index=1),
    "style_shift": Case(lambda _: StyleShiftTask(max_turns=3), style_actions, cut=1),
    "python_tool": Case(lambda _: PythonToolTask(seed=3, max_turns=6), python_actions, cut=2),
    "swe": Case(lambda _: SweTask(seed=4), swe_actions, cut=3),
    "latency_calculator": Case(
        lambda p: LatencyWrapper(calc(p), median_s=0.01, sleep=no_sleep), calc_actions, cut=2
    ),
    "latency_latency_guess": Case(
        lambda _: LatencyWrapper(LatencyWrapper(GuessNumberTask(), seed=1), sleep=no_sleep),
        guess_actions,
        cut=2,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_restored_env_plays_on_like_the_original(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    task = case.make_task(tmp_path)
    actions = case.actions(task.make_env(case.split, case.index))
    results = check_resume(task, case.split, case.index, actions, case.cut)
    assert results[-1].done  # every script plays its episode to the end


def test_style_shift_keeps_the_episode_preference_across_a_schedule_switch() -> None:
    """The preference is the one the episode began with, not the resumed task's."""
    task = StyleShiftTask(max_turns=2)
    original = task.make_env("train", 4)
    asyncio.run(original.reset(0))
    first, second = style_actions(original)
    asyncio.run(original.step(first))
    task.set_train_step(300)  # the resumed run is past the switch to "classical"
    restored = task.make_env("train", 4)
    assert restored.preferred == "classical"
    restored.load_state_dict(roundtrip(original.state_dict()))
    assert restored.preferred == "cute"
    assert asyncio.run(restored.step(second)) == asyncio.run(original.step(second))
    assert restored.score() == original.score() == 1.0


class PlainEnv:
    """An env without ``state_dict``: valid, but not restorable."""

    async def reset(self, seed: int) -> Observation:
        return "say hi"

    async def step(self, action: str) -> StepResult:
        return StepResult(None, done=True)

    def score(self) -> float:
        return 1.0


def test_latency_env_is_restorable_exactly_when_its_inner_env_is() -> None:
    wrapper = LatencyWrapper(GuessNumberTask(), sleep=no_sleep)
    restorable = wrapper.make_env("train", 0)
    assert isinstance(restorable, RestorableLatencyEnv)
    assert isinstance(restorable, RestorableEnv)
    plain = wrapper.wrap_env(PlainEnv())
    assert type(plain) is LatencyEnv and isinstance(plain, Env)
    assert not isinstance(plain, RestorableEnv)
    assert not hasattr(plain, "state_dict")  # never forwarded to the inner env
    with pytest.raises(TypeError, match="needs a RestorableEnv"):
        RestorableLatencyEnv(PlainEnv(), wrapper.draw, restorable._rng, no_sleep)


@pytest.mark.parametrize("name", ["calculator", "guess_number", "python_tool", "dataset", "swe"])
def test_state_of_another_problem_is_refused(name: str, tmp_path: Path) -> None:
    task = CASES[name].make_task(tmp_path)
    env = restorable(task.make_env("train", 0))
    others = (restorable(task.make_env("train", i)) for i in range(1, 50))
    other = next(e for e in others if e.state_dict() != env.state_dict())
    with pytest.raises(ValueError, match="same problem"):
        other.load_state_dict(env.state_dict())


@pytest.mark.parametrize(
    ("part", "key", "value", "match"),
    [
        ("inner", "turns", "3", "'turns': expected int"),
        ("inner", "found", 1, "'found': expected bool"),
        ("inner", "guesses", [4, "5"], "'guesses': expected int"),
        ("outer", "delays", None, "'delays': expected list"),
        ("outer", "rng", {"bit_generator": "MT19937"}, "PCG64"),
        ("outer", "rng", {"bit_generator": "PCG64"}, "'rng': not a PCG64 state"),
    ],
)
def test_damaged_state_is_refused(part: str, key: str, value: object, match: str) -> None:
    task = LatencyWrapper(GuessNumberTask(), sleep=no_sleep)
    state = restorable(task.make_env("train", 0)).state_dict()
    missing = {k: v for k, v in roundtrip(state).items() if k != "delays"}
    inner = state["inner"]
    assert isinstance(inner, dict)
    (inner if part == "inner" else state)[key] = value
    with pytest.raises(ValueError, match=match):
        restorable(task.make_env("train", 0)).load_state_dict(state)
    with pytest.raises(ValueError, match="no 'delays'"):
        restorable(task.make_env("train", 0)).load_state_dict(missing)


CALC_REPLIES = ["calc 2*3", "calc 1+2", "calc 1+", "calc 5//0", "calc 1+2+3", "answer 6", "x", ""]
GUESS_REPLIES = [*(f"guess {k}" for k in range(0, 10)), "guess", "nope"]


@settings(max_examples=40, deadline=None)
@given(
    index=st.integers(0, 30),
    actions=st.lists(st.sampled_from(CALC_REPLIES), max_size=8),
    cut=st.integers(0, 8),
)
def test_calculator_resumes_anywhere(index: int, actions: list[str], cut: int) -> None:
    task = CalculatorTask(seed=5, min_ops=1, max_ops=2)
    check_resume(task, "train", index, actions, min(cut, len(actions)))


@settings(max_examples=40, deadline=None)
@given(
    index=st.integers(0, 30),
    actions=st.lists(st.sampled_from(GUESS_REPLIES), max_size=6),
    cut=st.integers(0, 6),
)
def test_guess_number_resumes_anywhere(index: int, actions: list[str], cut: int) -> None:
    task = GuessNumberTask(seed=5, n=8)
    check_resume(task, "train", index, actions, min(cut, len(actions)))
