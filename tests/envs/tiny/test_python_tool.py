"""python_tool: an optimal scripted policy scores 1 on every kind; malformed,
empty, hostile and crashing replies get hints or tool errors, never exceptions."""

from __future__ import annotations

import pytest

from sao.envs.base import Env, Message, Split, Task
from sao.envs.tiny.python_tool import (
    KINDS,
    Problem,
    PythonToolEnv,
    PythonToolTask,
    normalize,
    parse_action,
)
from tests.envs.conftest import play, play_policy, replay


def optimal_policy(env: object) -> object:
    """Run the problem's reference program, then answer with its output."""
    code = env.problem.code  # type: ignore[attr-defined]

    def policy(obs: str) -> str:
        return f"run {code}" if obs == env.problem.text else f"answer {obs}"  # type: ignore[attr-defined]

    return policy


def solve(text: str) -> str:
    """The expected answer of a generated problem text, computed independently."""
    words = text.split()
    if text.startswith("digit sum of "):
        return str(sum(int(d) for d in words[-1]))
    if words[0] == "reverse":
        return words[1][::-1]
    if words[0] == "count":
        return str(words[3].count(words[1]))
    if words[0] == "sort":
        return "".join(sorted(words[1]))
    a, b = text.split("*")
    return str(int(a) * int(b))


def test_protocols() -> None:
    task = PythonToolTask()
    assert isinstance(task, Task) and isinstance(task.make_env("train", 0), Env)
    assert task.name == "python_tool" and task.eval_size == 200


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_optimal_policy_scores_one(kind: str) -> None:
    task = PythonToolTask(kinds=(kind,), seed=3)
    splits: tuple[tuple[Split, int], ...] = (("train", 0), ("eval", 1))
    for split, index in splits:
        env = task.make_env(split, index)
        ep = play_policy(env, optimal_policy(env))  # type: ignore[arg-type]
        assert ep.score == 1.0, (env.problem, ep.observations)
        assert ep.done and ep.results[-1].info["runs"] == 1


def test_fenced_block_and_chat_answer() -> None:
    env = PythonToolTask(kinds=("mul",)).make_env("train", 2)
    a, b = env.problem.text.split("*")
    reply = f"Let me compute it.\n```python\nx = {a}\nprint(x*{b})\n```"
    ep = play(env, [reply, f"The product is below.\nAnswer: {env.problem.answer}."])
    assert ep.observations[0] == env.problem.answer
    assert ep.score == 1.0


def test_parse_action() -> None:
    assert parse_action("run print(1)") == ("run", "print(1)")
    assert parse_action("run\nx = 2\nprint(x)") == ("run", "x = 2\nprint(x)")
    assert parse_action("answer 42") == ("answer", "42")
    assert parse_action("```python\nanswer = 5\nprint(answer)\n```") == (
        "run",
        "answer = 5\nprint(answer)",
    )
    assert parse_action("answer = 5") is None
    assert parse_action("hello") is None
    assert normalize(" 'ABC'. ") == "abc"


def test_malformed_and_empty_replies_get_hints() -> None:
    task = PythonToolTask(max_turns=4)
    env = task.make_env("train", 5)
    ep = play(env, ["hello", "answer", "run", "answer  "])
    assert ep.observations[:3] == [
        "format: run print(1+2) or answer 3",
        "empty answer; format: answer 3",
        "empty program; format: run print(1+2)",
    ]
    assert ep.done and ep.score == 0.0 and ep.results[-1].info["wasted"] == 4


def test_crashes_huge_output_and_loops_are_observations() -> None:
    task = PythonToolTask(kinds=("mul",), obs_chars=40, wall_s=1.0, max_turns=5)
    env = task.make_env("train", 7)
    ep = play(
        env,
        [
            "run 1/0",
            "run print('x' * 10**6)",
            "run while True: pass",
            "run import os\nwhile True: os.fork()",
            f"answer {env.problem.answer}",
        ],
    )
    crash, huge, loop, bomb = ep.observations[:4]
    assert crash == "ZeroDivisionError: division by zero"
    assert isinstance(huge, str) and len(huge) == 40 and huge.endswith("...")
    assert loop == "(stopped: timeout)", ep.observations
    assert isinstance(bomb, str) and "stopped" in bomb
    assert ep.score == 1.0


def test_wrong_answer_and_turn_limit() -> None:
    env = PythonToolTask(kinds=("mul",), max_turns=2).make_env("eval", 0)
    assert play(env, ["answer 1"]).score == 0.0
    env = PythonToolTask(kinds=("mul",), max_turns=2).make_env("eval", 0)
    ep = play(env, ["run print(1)", "run print(2)"])
    assert ep.done and ep.results[-1].observation is None and ep.score == 0.0


def test_splits_are_disjoint_and_deterministic() -> None:
    task = PythonToolTask(seed=1)
    train = {task.problem("train", i).text for i in range(400)}
    evals = {task.problem("eval", i).text for i in range(200)}
    assert not train & evals
    assert all(task.split_of(t) == "eval" for t in evals)
    assert PythonToolTask(seed=1).problem("train", 9) == task.problem("train", 9)


def test_system_message() -> None:
    env = PythonToolTask(system=True).make_env("train", 0)
    assert isinstance(env.first_observation(), tuple)
    first = env.first_messages()
    assert first[0].role == "system" and "answer" in first[0].content


def test_demonstrations_replay_and_are_imperfect() -> None:
    task = PythonToolTask(seed=2, error_rate=0.5)
    demos = task.demonstrations(40, seed=0)
    assert demos == task.demonstrations(40, seed=0)
    scores = []
    for demo in demos[:10]:
        assert demo[0].role == "user" and isinstance(demo[-1], Message)
        assert demo[-1].role == "assistant" and demo[-1].content.startswith("answer ")
        text = demo[0].content
        assert task.split_of(text) == "train"
        problem = Problem(text, solve(text), "", "", "")
        env = PythonToolEnv(
            problem, max_turns=4, system=False, obs_chars=200, wall_s=5.0, memory_mb=256
        )
        scores.append(replay(env, demo).score)
    assert 0 < sum(scores) < len(scores)


def test_bad_options_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="kinds"):
        PythonToolTask(kinds=("nope",))
    with pytest.raises(ValueError, match="error_rate"):
        PythonToolTask(error_rate=2.0)
