"""The calculator task: tool parser, episodes, robustness, splits, demonstrations."""

from __future__ import annotations

import asyncio

import pytest

from sao.envs.base import Env, Message, Task
from sao.envs.registry import make_task
from sao.envs.tiny.calculator import (
    FORMAT_HINT,
    CalcError,
    CalculatorEnv,
    CalculatorTask,
    evaluate,
    solve_steps,
)
from tests.envs.conftest import play, play_policy, replay


def optimal(env: CalculatorEnv) -> list[str]:
    """The optimal action sequence for an env's problem."""
    steps = solve_steps(env.problem)
    return [f"calc {e}" for e, _ in steps] + [f"answer {steps[-1][1]}"]


def test_protocols() -> None:
    task = CalculatorTask()
    assert isinstance(task, Task)
    assert isinstance(task.make_env("train", 0), Env)
    assert task.eval_size == 200
    assert isinstance(make_task("calculator", max_operand=9), CalculatorTask)


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("12*3", 36),
        ("2+3*4", 14),  # precedence: 2 + 12
        ("2*3+4", 10),
        ("10-4-3", 3),  # left associative: (10-4)-3
        ("-14+5", -9),
        ("(2+3)*-4", -20),
        ("7//2", 3),
        ("-7//2", -4),  # floor division
        (" 3 * 4 ", 12),
    ],
)
def test_evaluate(expr: str, value: int) -> None:
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    "expr",
    ["", "1+", "2**3", "1/2", "(1+2", "1 2", "__import__('os')", "1" * 10, "1+" * 40 + "1", "5//0"],
)
def test_evaluate_rejects(expr: str) -> None:
    with pytest.raises(CalcError):
        evaluate(expr)


def test_evaluate_counts_operators() -> None:
    assert evaluate("1+2", max_ops=1) == 3
    assert evaluate("-3+2", max_ops=1) == -1  # unary minus is not an operation
    with pytest.raises(CalcError, match="1 operation"):
        evaluate("1+2+3", max_ops=1)


def test_solve_steps_follows_precedence() -> None:
    # 3-10+2*4: 2*4 = 8 first, then 3-10 = -7, then -7+8 = 1.
    assert solve_steps("3-10+2*4") == [("2*4", 8), ("3-10", -7), ("-7+8", 1)]


def test_example_episode() -> None:
    env = CalculatorEnv(
        "12*3+7-5", 38, max_calls=4, max_turns=6, ops_per_call=1, require_call=True, system=False
    )
    ep = play(env, ["calc 12*3", "calc 36+7", "calc 43-5", "answer 38"])
    assert ep.first == "solve 12*3+7-5"
    assert ep.observations == ["=36", "=43", "=38", None]
    assert ep.done and ep.score == 1.0


@pytest.mark.parametrize("split", ["train", "eval"])
def test_optimal_policy_solves_everything(split: str) -> None:
    for allow_floordiv in (False, True):
        task = CalculatorTask(allow_floordiv=allow_floordiv)
        for i in range(40):
            env = task.make_env(split, i)  # type: ignore[arg-type]
            ep = play(env, optimal(env))
            assert ep.score == 1.0, env.problem
            assert ep.results[-1].info["wasted"] == 0


def test_wrong_answer_scores_zero() -> None:
    env = CalculatorTask().make_env("train", 3)
    actions = optimal(env)
    actions[-1] = f"answer {env.target + 1}"
    assert play(env, actions).score == 0.0


@pytest.mark.parametrize(
    "action",
    [
        "",
        "hello",
        "calc",
        "answer",
        "answer abc",
        "answer 1.5",
        "9" * 100_000,
        "calc " + "1+" * 50_000,
    ],
)
def test_malformed_actions_get_hints_and_zero(action: str) -> None:
    env = CalculatorTask().make_env("train", 0)
    ep = play(env, [action] * 10)
    assert ep.done and ep.score == 0.0
    assert len(ep.results) == env.max_turns
    first = ep.observations[0]
    assert isinstance(first, str) and len(first) < 60
    assert first == FORMAT_HINT or first.startswith("error")
    assert ep.results[-1].info["wasted"] == env.max_turns


def test_answer_before_any_call_is_refused() -> None:
    env = CalculatorTask().make_env("train", 1)
    ep = play(env, [f"answer {env.target}"] * 6)
    assert ep.observations[0] == "use calc first, e.g. calc 3*4"
    assert ep.score == 0.0
    free = CalculatorTask(require_call=False).make_env("train", 1)
    assert play(free, [f"answer {free.target}"]).score == 1.0


def test_call_budget_and_operation_limit() -> None:
    env = CalculatorTask(max_calls=3, max_turns=5).make_env("train", 0)
    ep = play(env, ["calc 1+2+3", "calc 1+1", "calc 1+1", "calc 1+1", "calc 1+1"])
    assert ep.observations[:4] == ["error: at most 1 operation(s) per call", "=2", "=2", "=2"]
    assert ep.done and ep.results[-1].info["calls"] == 3
    env = CalculatorTask(max_calls=3, max_turns=6).make_env("train", 0)
    ep = play(env, ["calc 1+1"] * 4)
    assert ep.observations[3] == "no calls left; answer N"


def test_last_line_is_read_and_case_is_ignored() -> None:
    env = CalculatorTask().make_env("train", 2)
    actions = ["Let me compute.\n" + a.upper().replace("CALC", "Calc:") for a in optimal(env)]
    assert play(env, actions).score == 1.0


def test_score_always_works_and_steps_after_done() -> None:
    env = CalculatorTask().make_env("eval", 0)
    assert env.score() == 0.0  # before reset
    ep = play(env, optimal(env))
    after = asyncio.run(env.step("answer 0"))
    assert after.done and ep.score == env.score() == 1.0


def test_train_and_eval_are_disjoint_and_deterministic() -> None:
    task = CalculatorTask(seed=3)
    train = {task.problem("train", i).text for i in range(3000)}
    evals = {task.problem("eval", i).text for i in range(task.eval_size)}
    assert not train & evals
    assert all(task.split_of(t) == "eval" for t in evals)
    again = CalculatorTask(seed=3)
    assert [again.problem("eval", i) for i in range(20)] == [
        task.problem("eval", i) for i in range(20)
    ]
    other = CalculatorTask(seed=4)
    assert [other.problem("train", i) for i in range(20)] != [
        task.problem("train", i) for i in range(20)
    ]


def test_demonstrations_match_env_and_are_imperfect() -> None:
    task = CalculatorTask()
    demos = task.demonstrations(300, seed=1)
    assert demos == task.demonstrations(300, seed=1)
    assert demos != task.demonstrations(300, seed=2)
    scores = []
    for conv in demos:
        problem = conv[0].content.removeprefix("solve ")
        env = CalculatorEnv(
            problem,
            evaluate(problem),
            max_calls=4,
            max_turns=6,
            ops_per_call=1,
            require_call=True,
            system=False,
        )
        scores.append(replay(env, conv).score)
        assert all(isinstance(m, Message) for m in conv)
        assert task.split_of(problem) == "train"
    assert 0.6 < sum(scores) / len(scores) < 0.95


def test_demonstrations_call_the_whole_problem_when_the_tool_allows() -> None:
    # ops_per_call=2 and at most 2 operations: a clean demo is one call and an answer;
    # the early-answer habit calls the first operation only and answers its result.
    task = CalculatorTask(
        min_ops=1, max_ops=2, ops_per_call=2, error_rate=0.0, early_answer_rate=0.5
    )
    kinds: dict[str, int] = {"whole": 0, "habit": 0}
    for conv in task.demonstrations(400, seed=3):
        problem = conv[0].content.removeprefix("solve ")
        actions = [m.content for m in conv if m.role == "assistant"]
        assert len(actions) == 2 and actions[1].startswith("answer ")
        first_op, first_value = solve_steps(problem)[0]
        if actions[0] == f"calc {problem}":
            kinds["whole"] += 1
            assert actions[1] == f"answer {evaluate(problem)}"
        else:
            kinds["habit"] += 1
            assert actions == [f"calc {first_op}", f"answer {first_value}"]
    # the habit is visible only on two-operation problems (about half of them)
    assert kinds["habit"] > 60 and kinds["whole"] > 200
    # floor division counts as one operation: with one operation per call, a problem
    # such as 12//3+4 takes two calls (user, calc, =, calc, =, answer)
    floordiv = CalculatorTask(
        min_ops=2, max_ops=2, ops_per_call=1, allow_floordiv=True, error_rate=0.0
    )
    demos = [c for c in floordiv.demonstrations(60, seed=0) if "//" in c[0].content]
    assert demos and all(len(conv) == 6 for conv in demos)


def test_system_message_option() -> None:
    task = CalculatorTask(system=True)
    env = task.make_env("train", 0)
    first = play(env, []).first
    assert isinstance(first, tuple)
    assert [getattr(m, "role", None) for m in first] == ["system", "user"]
    demo = task.demonstrations(1, seed=0)[0]
    assert demo[0].role == "system" and demo[1].role == "user"


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"min_ops": 3, "max_ops": 2}, "min_ops"),
        ({"max_operand": 1}, "max_operand"),
        ({"max_calls": 2}, "max_calls"),
        ({"max_turns": 4}, "max_turns"),
        ({"error_rate": 1.5}, "error_rate"),
        ({"eval_size": 0}, "eval_size"),
    ],
)
def test_options_are_validated(kwargs: dict[str, int], option: str) -> None:
    with pytest.raises(ValueError, match=option):
        CalculatorTask(**kwargs)  # type: ignore[arg-type]


def test_bad_split_or_index() -> None:
    task = CalculatorTask()
    with pytest.raises(ValueError, match="split"):
        task.make_env("test", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="index"):
        task.make_env("train", -1)


def test_adaptive_policy_reading_observations() -> None:
    """A policy that reads each '=N' observation and chains it forward."""
    env = CalculatorTask().make_env("eval", 5)
    steps = solve_steps(env.problem)
    queue = [f"calc {e}" for e, _ in steps]

    def policy(obs: str) -> str:
        if queue:
            return queue.pop(0)
        return f"answer {obs.removeprefix('=')}"

    assert play_policy(env, policy).score == 1.0
