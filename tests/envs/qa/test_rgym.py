"""reasoning_gym: real datasets scored by their own ``score_answer``; unknown
names list the valid ones; a raising scorer is a zero with its reason."""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym")

from sao.envs.base import Env, Task
from sao.envs.qa.rgym import ReasoningGymTask, dataset_names
from tests.envs.conftest import play

NAMES = ("basic_arithmetic", "leg_counting")


def reply(task: ReasoningGymTask, split: str, index: int, text: str) -> tuple[float, str]:
    ep = play(task.make_env(split, index), [text])  # type: ignore[arg-type]
    return ep.score, str(ep.results[-1].info.get("error", ""))


def test_names_exist_in_installed_version() -> None:
    assert set(NAMES) <= set(dataset_names())


@pytest.mark.parametrize("name", NAMES)
def test_reference_answer_scores_one_and_wrong_scores_zero(name: str) -> None:
    task = ReasoningGymTask(name, seed=1, eval_size=5, train_size=50)
    assert isinstance(task, Task) and isinstance(task.make_env("train", 0), Env)
    for split, index in (("train", 3), ("eval", 2)):
        entry = task.entry(split, index)  # type: ignore[arg-type]
        assert reply(task, split, index, f"answer {entry['answer']}")[0] == 1.0
        assert reply(task, split, index, "answer 123456789")[0] == 0.0


def test_a_reply_without_a_marker_scores_zero_and_is_counted() -> None:
    task = ReasoningGymTask("basic_arithmetic", seed=1, eval_size=3, train_size=10)
    answer = str(task.entry("eval", 0)["answer"])
    ep = play(task.make_env("eval", 0), [answer])
    assert ep.score == 0.0 and ep.results[-1].info["metric/format/missing_answer"] == 1.0
    ep = play(task.make_env("eval", 0), [f"\\boxed{{{answer}}}"])
    assert ep.score == 1.0 and ep.results[-1].info["metric/format/missing_answer"] == 0.0
    lax = ReasoningGymTask(
        "basic_arithmetic", seed=1, eval_size=3, train_size=10, require_marker=False
    )
    ep = play(lax.make_env("eval", 0), [answer])
    assert ep.score == 1.0 and ep.results[-1].info["metric/format/missing_answer"] == 1.0


def test_prompt_is_question_plus_instruction() -> None:
    task = ReasoningGymTask("basic_arithmetic", eval_size=3, train_size=10)
    env = task.make_env("eval", 0)
    assert env.first_observation() == f"{env.entry['question']}\nFinish with 'answer X'."
    with_system = ReasoningGymTask(
        "basic_arithmetic", eval_size=3, train_size=10, system="Be exact."
    )
    env = with_system.make_env("eval", 0)
    assert isinstance(env.first_observation(), tuple)
    assert env.first_messages()[0].role == "system"


def test_splits_come_from_different_seeds_and_never_share_questions() -> None:
    task = ReasoningGymTask("basic_arithmetic", seed=0, eval_size=50, train_size=500)
    evals = {task.entry("eval", i)["question"] for i in range(50)}
    train = {task.entry("train", i)["question"] for i in range(500)}
    assert not evals & train
    assert task.entry("eval", 0) == ReasoningGymTask("basic_arithmetic", eval_size=50).entry(
        "eval", 0
    )
    with pytest.raises(IndexError):
        task.entry("eval", 50)


def test_unknown_name_lists_valid_ones_and_closest() -> None:
    with pytest.raises(ValueError, match="Did you mean 'leg_counting'") as err:
        ReasoningGymTask("leg_countin")
    assert "basic_arithmetic" in str(err.value)


def test_raising_scorer_is_zero_with_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    task = ReasoningGymTask("leg_counting", eval_size=3, train_size=10)

    def broken(answer: object, entry: object) -> float:
        raise KeyError("metadata")

    monkeypatch.setattr(task.eval_data, "score_answer", broken)
    entry = task.entry("eval", 0)
    score, error = reply(task, "eval", 0, f"answer {entry['answer']}")
    assert score == 0.0 and "KeyError" in error


def test_demonstrations_are_imperfect() -> None:
    task = ReasoningGymTask("leg_counting", seed=2, eval_size=3, train_size=200, error_rate=0.3)
    demos = task.demonstrations(60, seed=0)
    assert demos == task.demonstrations(60, seed=0)
    correct = 0
    for demo in demos:
        assert demo[0].role == "user" and demo[-1].role == "assistant"
        index = next(
            i for i in range(200) if str(task.entry("train", i)["question"]) in demo[0].content
        )
        correct += reply(task, "train", index, demo[-1].content)[0] == 1.0
    assert 30 < correct < 58


def test_shots_come_first_as_answered_chat_turns_from_the_train_split() -> None:
    task = ReasoningGymTask("basic_arithmetic", seed=1, eval_size=5, train_size=50, shots=2)
    env = task.make_env("eval", 0)
    msgs = env.first_messages()
    assert [m.role for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    first, second = task.entry("train", 0), task.shots[1][0]
    assert msgs[0].content == f"{first['question']}\nFinish with 'answer X'."
    assert msgs[1].content == f"answer {first['answer']}"
    assert msgs[3].content == f"answer {second['answer']}"
    assert msgs[-1].content == f"{env.entry['question']}\nFinish with 'answer X'."
    eval_questions = {task.entry("eval", i)["question"] for i in range(5)}
    assert first["question"] != second["question"]
    assert not {s["question"] for s, _ in task.shots} & eval_questions
    assert env.first_observation() == tuple(msgs)  # several messages: the whole chat
    assert task.make_env("train", 7).first_messages()[:4] == msgs[:4]  # the same shots
    with pytest.raises(ValueError, match="option shots: use 0 to 16"):
        ReasoningGymTask("basic_arithmetic", eval_size=3, train_size=10, shots=17)
    worked = ReasoningGymTask(
        "basic_arithmetic", seed=1, eval_size=5, train_size=50, shots=1,
        shot_reply="{expression} = {answer}\nanswer {answer}",
    )  # fmt: skip
    expression = first["metadata"]["expression"]
    assert worked.make_env("eval", 0).first_messages()[1].content == (
        f"{expression} = {first['answer']}\nanswer {first['answer']}"
    )
    with pytest.raises(ValueError, match=r"shot_reply: '\{steps\}' cannot be filled.*expression"):
        ReasoningGymTask(
            "basic_arithmetic", eval_size=3, train_size=10, shots=1, shot_reply="{steps}"
        )


ONE_DIGIT = {
    "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
    "operators": ["+", "-"], "allow_parentheses": False, "allow_negation": False,
}  # fmt: skip


def test_shots_seed_fixes_the_shots_whatever_the_runs_seed() -> None:
    def task(seed: int, shots_seed: int | None) -> ReasoningGymTask:
        return ReasoningGymTask(
            config=ONE_DIGIT, seed=seed, eval_size=100, train_size=500, shots=3,
            scorer="math", shots_seed=shots_seed,
        )  # fmt: skip

    fixed = [task(seed, 0) for seed in (0, 1, 2, 11)]
    shots = {tuple((e["question"], r) for e, r in t.shots) for t in fixed}
    assert len(shots) == 1  # one set of shots for every seed
    # ... and with the run's seed they differ (seed 11's held `3 - 4` -> `answer -1`)
    assert len({tuple(e["question"] for e, _ in task(s, None).shots) for s in (0, 1, 11)}) == 3
    for t in fixed:  # never a held-out question, and still eval_size held-out entries
        asked = {e["question"] for e, _ in t.shots}
        held_out = [t.entry("eval", i)["question"] for i in range(t.eval_size)]
        assert t.eval_size == 100 and not asked & set(held_out)
        assert t.make_env("eval", 99).first_messages()[1].content == t.shots[0][1]
        with pytest.raises(IndexError):
            t.entry("eval", 100)
    # seed 0's shots are its own train split's first ones: seed 0 is unchanged
    plain = task(0, None)
    assert [e["question"] for e, _ in plain.shots] == [e["question"] for e, _ in fixed[0].shots]
    assert all(plain.entry("eval", i) == fixed[0].entry("eval", i) for i in range(100))


def test_the_math_scorer_gives_no_partial_credit_and_wants_a_value() -> None:
    task = ReasoningGymTask("basic_arithmetic", seed=1, eval_size=5, train_size=50)
    strict = ReasoningGymTask("basic_arithmetic", seed=1, eval_size=5, train_size=50, scorer="math")
    entry = strict.entry("eval", 0)
    answer, expression = str(entry["answer"]), str(entry["metadata"]["expression"])
    padded = f"answer {answer}0"  # contains the reference: the dataset's own scorer credits it
    assert 0.0 < reply(task, "eval", 0, padded)[0] < 1.0
    assert reply(strict, "eval", 0, padded)[0] == 0.0
    assert reply(strict, "eval", 0, f"answer {answer}")[0] == 1.0
    assert reply(strict, "eval", 0, f"answer {float(answer)}")[0] == 1.0  # the same value
    assert reply(strict, "eval", 0, f"answer {expression}")[0] == 0.0  # the question echoed
    with pytest.raises(ValueError, match="option scorer: use 'dataset' or 'math'"):
        ReasoningGymTask("basic_arithmetic", eval_size=3, train_size=10, scorer="exact")  # type: ignore[arg-type]
