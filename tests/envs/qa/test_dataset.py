"""dataset: JSONL, Parquet and saved ``datasets`` sources; math-verify, exact
and custom scorers; clear errors for missing files and fields."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from sao.envs.base import Env, Task
from sao.envs.qa.dataset import (
    DatasetTask,
    exact_score,
    extract_answer,
    math_score,
    safe_score,
)
from tests.envs.conftest import play

ROWS = [
    {"q": "What is 1/4 + 1/4?", "a": "\\frac{1}{2}"},
    {"q": "What is 2+3?", "a": "5"},
    {"q": "Capital of France?", "a": "Paris"},
    {"q": "What is 10/4?", "a": "2.5"},
]


def write_jsonl(path: Path, rows: Sequence[Mapping[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def reply(task: DatasetTask, split: str, index: int, text: str) -> tuple[float, dict[str, object]]:
    ep = play(task.make_env(split, index), [text])  # type: ignore[arg-type]
    return ep.score, dict(ep.results[-1].info)


def test_jsonl_episode_and_protocols(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    evals = write_jsonl(tmp_path / "eval.jsonl", ROWS[:2])
    task = DatasetTask(train, evals, prompt_key="q", answer_key="a")
    assert isinstance(task, Task) and isinstance(task.make_env("eval", 0), Env)
    assert task.eval_size == 2
    env = task.make_env("eval", 0)
    first = asyncio.run(env.reset(0))
    assert first == "What is 1/4 + 1/4?\nFinish with 'answer X'."
    assert reply(task, "eval", 0, "answer \\boxed{1/2}")[0] == 1.0
    assert reply(task, "eval", 0, "so it is 0.5\nanswer 0.5")[0] == 1.0
    assert reply(task, "eval", 0, "answer 0.25")[0] == 0.0
    assert reply(task, "eval", 1, "answer 5")[0] == 1.0
    with pytest.raises(IndexError):
        task.make_env("eval", 2)


def test_parquet_and_held_out_fraction(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"What is {i}+1?", "answer": i + 1} for i in range(200)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data.parquet")
    task = DatasetTask(tmp_path / "data.parquet", eval_fraction=0.2, seed=3)
    train = {e.prompt for e in task.train}
    evals = {e.prompt for e in task.eval}
    assert not train & evals and len(train) + len(evals) == 200
    assert 20 < len(evals) < 60
    again = DatasetTask(tmp_path / "data.parquet", eval_fraction=0.2, seed=3)
    assert [e.prompt for e in again.eval] == [e.prompt for e in task.eval]
    answer = task.make_env("train", 0).example.answer
    assert reply(task, "train", 0, f"answer {answer}")[0] == 1.0


def test_saved_datasets_directory(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    data = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(
                [{"question": r["q"], "gold": r["a"]} for r in ROWS]
            ),
            "test": datasets.Dataset.from_list([{"question": "2*2?", "gold": "4"}]),
        }
    )
    data.save_to_disk(str(tmp_path / "saved"))
    task = DatasetTask(tmp_path / "saved", prompt_key="question", answer_key="gold")
    assert task.eval_size == 1 and len(task.train) == 4
    assert reply(task, "eval", 0, "answer 4")[0] == 1.0
    single = tmp_path / "single"
    data["train"].save_to_disk(str(single))
    task = DatasetTask(single, prompt_key="question", answer_key="gold", eval_fraction=0.5)
    assert task.eval_size + len(task.train) == 4


def test_chat_prompts_and_system(tmp_path: Path) -> None:
    rows = [{"prompt": [{"role": "user", "content": "Say hi"}], "answer": "hi"}] * 3
    task = DatasetTask(
        write_jsonl(tmp_path / "t.jsonl", rows),
        write_jsonl(tmp_path / "e.jsonl", rows),
        scorer="exact",
        system="Be brief.",
        instruction=None,
    )
    env = task.make_env("eval", 0)
    assert isinstance(env.first_observation(), tuple)
    first = env.first_messages()
    assert [m.role for m in first] == ["system", "user"]
    assert first[1].content == "Say hi"


def test_exact_and_math_scorers() -> None:
    assert exact_score("answer Paris.", "paris") == 1.0
    assert exact_score("answer $5$", "5") == 1.0
    assert exact_score("answer Lyon", "Paris") == 0.0
    assert math_score("the result is \\boxed{1/2}", "0.5") == 1.0
    assert math_score("answer 1/3", "0.5") == 0.0
    assert extract_answer("work...\nanswer: 7\n") == "7"
    assert extract_answer("x <answer>3</answer>") == "3"
    assert extract_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"


def test_math_score_off_the_main_thread() -> None:
    out: list[float] = []
    thread = threading.Thread(target=lambda: out.append(math_score("\\boxed{1/2}", "0.5")))
    thread.start()
    thread.join()
    assert out == [1.0]


def test_custom_and_raising_scorers(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)

    def length_scorer(response: str, answer: str) -> float:
        return 1.0 if len(response) == len(answer) else 0.5

    task = DatasetTask(path, path, prompt_key="q", answer_key="a", scorer=length_scorer)
    assert reply(task, "eval", 2, "Lyon!")[0] == 1.0
    assert reply(task, "eval", 2, "no")[0] == 0.5

    def broken(response: str, answer: str) -> float:
        raise RuntimeError("scorer exploded")

    task = DatasetTask(path, path, prompt_key="q", answer_key="a", scorer=broken)
    score, info = reply(task, "eval", 0, "answer 1")
    assert score == 0.0 and "RuntimeError: scorer exploded" in str(info["error"])
    assert safe_score(lambda: float("nan"))[0] == 0.0
    assert safe_score(lambda: "1")[1] is not None


def test_unparseable_reference_is_a_zero_with_reason(tmp_path: Path) -> None:
    rows = [{"prompt": "p", "answer": "}{"}] * 2
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    task = DatasetTask(path, path)
    score, info = reply(task, "eval", 0, "answer 1")
    assert score == 0.0 and "reference answer" in str(info["error"])


def test_missing_file_and_field_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"train_path.*nope\.jsonl"):
        DatasetTask(tmp_path / "nope.jsonl")
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"no field 'prompt'.*prompt_key"):
        DatasetTask(path)
    with pytest.raises(ValueError, match=r"no field 'answer'.*answer_key"):
        DatasetTask(path, prompt_key="q")
    with pytest.raises(FileNotFoundError, match="eval_path"):
        DatasetTask(path, tmp_path / "missing.parquet", prompt_key="q", answer_key="a")
    with pytest.raises(ValueError, match="scorer"):
        DatasetTask(path, prompt_key="q", answer_key="a", scorer="fuzzy")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"\.jsonl/\.json/\.parquet"):
        DatasetTask(tmp_path / "data.csv")


def test_demonstrations_are_imperfect(tmp_path: Path) -> None:
    rows = [{"prompt": f"{i}+{i}?", "answer": str(2 * i)} for i in range(50)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    task = DatasetTask(path, path, scorer="exact", error_rate=0.3)
    demos = task.demonstrations(100, seed=0)
    assert demos == task.demonstrations(100, seed=0)
    right = 0
    for demo in demos:
        prompt = demo[0].content.split("\n")[0]
        assert demo[-1].role == "assistant" and demo[-1].content.startswith("answer ")
        truth = str(2 * int(prompt.split("+")[0]))
        right += exact_score(demo[-1].content, truth) == 1.0
    assert 50 < right < 95


def test_echo_scores_zero_and_counts_a_missing_answer(tmp_path: Path) -> None:
    rows = [{"prompt": "What is 16 - 45?", "answer": "-29"}] * 2
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    task = DatasetTask(path, path)
    score, info = reply(task, "eval", 0, "16 - 45")
    assert score == 0.0 and info["metric/format/missing_answer"] == 1.0
    score, info = reply(task, "eval", 0, "answer 16 - 45")
    assert score == 0.0 and info["metric/format/missing_answer"] == 0.0
    score, info = reply(task, "eval", 0, "16 - 45 = -29\nanswer -29")
    assert score == 1.0 and info["metric/format/missing_answer"] == 0.0
    # both opt-outs together bring the echo back: the documented hazard
    lax = DatasetTask(path, path, require_marker=False, require_value=False)
    score, info = reply(lax, "eval", 0, "16 - 45")
    assert score == 1.0 and info["metric/format/missing_answer"] == 1.0
    exact = DatasetTask(path, path, scorer="exact", require_marker=False)
    assert reply(exact, "eval", 0, "-29")[0] == 1.0


def test_answer_rule_options_must_be_booleans(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(ValueError, match="option require_marker: use true or false"):
        DatasetTask(path, prompt_key="q", answer_key="a", require_marker="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="option require_value: use true or false"):
        DatasetTask(path, prompt_key="q", answer_key="a", require_value=0)  # type: ignore[arg-type]
