"""The ``swe`` environment: scripted policies (optimal ones score 1 on train
and eval problems), the tool protocol and its error observations, grading
(binary and partial, hand-worked), SWE-bench-layout instance files, state
round trips and clean-up of every working copy."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from sao.envs._tools import ToolCall, ToolCallError
from sao.envs.registry import make_task
from sao.envs.swe import SweEnv, SweTask, parse_call, reward_of
from sao.envs.swe.grading import parse_results
from sao.envs.swe.protocol import FORMAT, USAGE
from sao.envs.swe.synthetic import SyntheticBug
from sao.envs.swe.task import _predicted_tests
from tests.envs.conftest import Episode, play


def leftovers() -> set[str]:
    """Working copies and sandbox directories in the temp dir."""
    prefixes = ("sao-swe-", "sao-sandbox-")
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(prefixes)}


@pytest.fixture(autouse=True)
def nothing_left_behind(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> object:
    """Each test gets a temp dir of its own (so other runs on the machine do not
    count); no working copy or sandbox directory may be left in it."""
    tmp_path_factory.getbasetemp()  # pytest's own temp dirs stay where they are
    private = tempfile.mkdtemp(prefix="sao-test-tmp-")
    os.chmod(private, 0o711)  # the sandbox uid traverses it, as it does /tmp
    monkeypatch.setattr(tempfile, "tempdir", private)
    yield
    gc.collect()
    left = leftovers()
    monkeypatch.undo()
    shutil.rmtree(private, ignore_errors=True)
    assert not left, f"left behind: {sorted(left)}"


def fix(bug: SyntheticBug) -> str:
    return f"replace {bug.module} {bug.old} => {bug.new}"


def solve(task: SweTask, split: str, index: int, *extra: str) -> Episode:
    """Read, fix, (extra actions), submit."""
    bug = task.bug(split, index)  # type: ignore[arg-type]
    env = task.make_env(split, index)  # type: ignore[arg-type]
    return play(env, [f"read {bug.module}", fix(bug), *extra, "submit"])


@pytest.mark.parametrize(("split", "index"), [("train", 0), ("train", 1), ("eval", 0), ("eval", 1)])
def test_optimal_policy_scores_one(split: str, index: int) -> None:
    ep = solve(SweTask(), split, index)
    info = ep.results[-1].info
    assert ep.score == 1.0 and ep.done
    assert info["test_status"] == "ok" and info["f2p_passed"] == info["f2p_total"] == 1
    assert info["tests_restored"] == 0


def test_unfixed_and_wrong_fixes_score_zero() -> None:
    task = SweTask()
    bug = task.bug("train", 2)
    assert play(task.make_env("train", 2), ["submit"]).score == 0.0
    wrong = f"replace {bug.module} {bug.old} => {bug.old} + 1"
    ep = play(task.make_env("train", 2), [wrong, "submit"])
    assert ep.score == 0.0 and ep.results[-1].info["f2p_passed"] == 0


def test_problems_are_deterministic_and_the_eval_split_is_disjoint() -> None:
    a, b = SweTask(seed=1), SweTask(seed=1)
    assert a.problem("train", 5) == b.problem("train", 5)
    assert a.problem("train", 5) != SweTask(seed=2).problem("train", 5)
    train = {a.problem("train", i).text for i in range(150)}
    evals = {a.problem("eval", i).text for i in range(40)}
    assert len(evals) > 30 and not train & evals
    assert all(a.split_of(t) == "eval" for t in evals)
    assert isinstance(make_task("swe"), SweTask)


def test_families_option_limits_the_bugs() -> None:
    task = SweTask(families=("off_by_one",))
    assert {task.bug("train", i).family for i in range(20)} == {"off_by_one"}
    with pytest.raises(ValueError, match="families"):
        SweTask(families=("typo",))


def test_the_issue_quotes_the_bug_and_the_fix() -> None:
    bug = SweTask().bug("train", 1)
    assert bug.problem.issue == "basic.py: sub(u, v) returns v - u; it should return u - v"
    assert (bug.family, bug.old, bug.new) == ("swapped_args", "v - u", "u - v")
    assert f"    return {bug.old}\n" in bug.problem.files[0][1]
    # sub has no other swapped_args bug: the wrong fix is its wrong_operator bug.
    assert bug.wrong_new == "u + v"


def test_every_wrong_fix_still_fails_the_bugs_test() -> None:
    """The habit's fix (``wrong_new``) is never the fix: the buggy function's
    test fails with it, for every function and bug drawn."""
    task = SweTask()
    for bug in (task.bug("train", i) for i in range(300)):
        assert bug.wrong_new != bug.new
        assert f"FAIL {bug.problem.fail_to_pass[0]}: " in _predicted_tests(bug, fixed=False)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"habit_rate": 1.5}, "habit_rate"),
        ({"habit_rate": -0.1}, "habit_rate"),
        ({"habit_families": ("typo",)}, "habit_families"),
        ({"habit_families": ()}, "habit_families"),
        ({"families": ("wrong_operator",), "habit_families": ("off_by_one",)}, "habit_families"),
    ],
)
def test_bad_habit_options_are_named(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"option {message}:"):
        SweTask(**options)  # type: ignore[arg-type]


def test_habit_rate_is_the_share_of_habit_family_demonstrations_with_a_wrong_fix() -> None:
    """Without other flaws (error_rate=0) a demonstration fixes the bug or, for a
    habit family, makes the habitual wrong fix. 2000 demonstrations hold ~1250
    wrong_operator ones (5 of the 8 functions): the share's standard error is
    sqrt(0.65 * 0.35 / 1250) = 0.013, so 0.05 is about four of them."""
    task = SweTask(
        families=("wrong_operator", "missing_edge_case"),
        habit_families=("wrong_operator",),
        habit_rate=0.65,
        error_rate=0.0,
    )
    habits: dict[bool, list[bool]] = {True: [], False: []}
    for demo in task.demonstrations(2000, seed=0):
        replies = [m.content for m in demo if m.role == "assistant"]
        path, rest = demo[0].content.split(": ", 1)
        function, rest = rest.split("(", 1)
        old, fix = rest.split(" returns ", 1)[1].split("; it should return ")
        assert replies[0] == f"read {path}" and replies[-1] == "submit" and len(replies) == 3
        assert replies[1].startswith(f"replace {path} {old} => ")
        operator_bug = function in ("add", "sub", "mul", "div", "power")
        habits[operator_bug].append(not replies[1].endswith(f" => {fix}"))
    assert len(habits[True]) > 1000 and len(habits[False]) > 500
    assert abs(sum(habits[True]) / len(habits[True]) - 0.65) < 0.05
    assert not any(habits[False])


# ---------------------------------------------------------------- protocol


@pytest.mark.parametrize(
    ("reply", "call"),
    [
        ("ls", ToolCall("ls", {})),
        ("ls pkg", ToolCall("ls", {"path": "pkg"})),
        ("read a.py 2 5", ToolCall("read", {"path": "a.py", "start": 2, "end": 5})),
        (
            "replace a.py x - y => x + y",
            ToolCall("replace", {"path": "a.py", "old": "x - y", "new": "x + y"}),
        ),
        (
            "replace a.py\nif x:\n=>\nif y:",
            ToolCall("replace", {"path": "a.py", "old": "if x:", "new": "if y:"}),
        ),
        (
            "edit a.py 2 3\n    return 1",
            ToolCall("edit", {"path": "a.py", "start": 2, "end": 3, "text": "    return 1"}),
        ),
        ("edit a.py 2 3", ToolCall("edit", {"path": "a.py", "start": 2, "end": 3, "text": ""})),
        ("run grep -n def *.py", ToolCall("run", {"command": "grep -n def *.py"})),
        ("  SUBMIT \n", ToolCall("submit", {})),
        (
            '<tool_call>{"name": "read", "arguments": {"path": "a.py", "start": 1}}</tool_call>',
            ToolCall("read", {"path": "a.py", "start": 1}),
        ),
        ('<tool_call>{"name": "submit"}</tool_call>', ToolCall("submit", {})),
    ],
)
def test_tool_calls_parse(reply: str, call: ToolCall) -> None:
    assert parse_call(reply) == call


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        ("", f"error: empty reply; {FORMAT}"),
        ("open a.py", f"error: unknown tool 'open'; {FORMAT}"),
        ("read", f"error: read needs a path; format: {USAGE['read']}"),
        ("read a.py one", f"error: line numbers must be whole numbers; format: {USAGE['read']}"),
        (
            "replace a.py x - y",
            f"error: no ' => ' between the old and the new text; format: {USAGE['replace']}",
        ),
        ("edit a.py 3", f"error: edit needs a path and two line numbers; format: {USAGE['edit']}"),
        ("run", f"error: run needs a command; format: {USAGE['run']}"),
        ("submit now", f"error: submit takes no arguments; format: {USAGE['submit']}"),
        ("<tool_call>{read}</tool_call>", "the tool call is not valid JSON"),
        ('<tool_call>{"name": "read", "arguments": {"path": 3}}</tool_call>', "path must be text"),
        (
            '<tool_call>{"name": "read", "arguments": {"file": "a"}}</tool_call>',
            "read takes no argument 'file'",
        ),
    ],
)
def test_malformed_calls_say_what_is_wrong_and_the_format(reply: str, message: str) -> None:
    with pytest.raises(ToolCallError) as err:
        parse_call(reply)
    assert message in str(err.value)


def test_malformed_call_wastes_a_turn_with_the_error_observation() -> None:
    task = SweTask(max_turns=3)
    ep = play(task.make_env("train", 0), ["read", "hello", "submit"])
    assert ep.observations[:2] == [
        f"error: read needs a path; format: {USAGE['read']}",
        f"error: unknown tool 'hello'; {FORMAT}",
    ]
    assert ep.results[-1].info["wasted"] == 2 and ep.score == 0.0


def test_file_tools_read_ranges_edit_lines_and_cut_long_output() -> None:
    task = SweTask(obs_chars=64)
    bug = task.bug("train", 3)
    n = bug.line
    actions = [
        f"read {bug.module} {n} {n}",
        f"edit {bug.module} {n} {n}\n    return {bug.new}",
        f"read {bug.module} {n} {n}",
        f"replace {bug.module} nothing-like-this => x",
        f"read {bug.module} 99",
        "read run_tests.py",
        "submit",
    ]
    ep = play(task.make_env("train", 3), actions)
    obs = ep.observations
    assert obs[0] == f"{n}     return {bug.old}"
    assert obs[1] == f"edited {bug.module}:\n{n}     return {bug.new}"
    assert obs[2] == f"{n}     return {bug.new}"
    assert obs[3] == f"error: old text not found in {bug.module}"
    assert obs[4].startswith(f"error: {bug.module} has ")
    assert isinstance(obs[5], str) and len(obs[5]) <= 64
    assert obs[5].endswith("...(cut) (read run_tests.py START END for more)")
    assert ep.score == 1.0


def test_paths_outside_the_working_copy_are_refused(tmp_path: Path) -> None:
    env = SweTask(max_turns=10).make_env("train", 0)

    async def go() -> list[str | None]:
        await env.reset(0)
        assert env.workspace.root is not None
        (env.workspace.root / "out").symlink_to("/etc")
        obs = []
        for action in [
            "read /etc/passwd",
            "read ../../etc/passwd",
            "read out/passwd",
            "replace out/hostname a => b",
            "ls out",
            "ls",
            "run ln -s /etc/passwd pw",
            "read pw",
        ]:
            obs.append((await env.step(action)).observation)  # type: ignore[arg-type]
        changes = env.state_dict()["changes"]
        assert isinstance(changes, dict) and changes["text"] == {}  # /etc is never read
        await env.step("submit")
        return obs

    obs = asyncio.run(go())
    assert obs[0] == "refused: /etc/passwd is absolute; use a path inside the repository"
    assert obs[1] == "refused: ../../etc/passwd leaves the repository ('..')"
    assert obs[2] == "refused: out/passwd leads outside the repository (a link)"
    assert all(isinstance(o, str) and o.startswith("refused:") for o in obs[3:5])
    assert obs[5] is not None and "out" in obs[5].split("\n") and "passwd" not in obs[5]
    assert obs[7] == "error: pw does not exist (ls lists the files)"  # links are not kept
    assert env.score() == 0.0


# ---------------------------------------------------------------- adversarial


def test_deleting_or_editing_the_tests_never_helps() -> None:
    task = SweTask()
    bug = task.bug("train", 4)
    test_file = bug.problem.test_files[0][0]
    env = task.make_env("train", 4)
    ep = play(env, ["run rm -f test_*.py run_tests.py", "submit"])
    assert ep.score == 0.0 and ep.results[-1].info["tests_restored"] == 2
    # Editing the failing test so that it passes: restored when protected...
    names = [t.split("::")[1] for t in bug.problem.fail_to_pass + bug.problem.pass_to_pass]
    body = "".join(f"def {name}():\\n    pass\\n" for name in names)
    cheat = f"run printf '{body}' > {test_file}"
    ep = play(task.make_env("train", 4), [cheat, "submit"])
    info = ep.results[-1].info
    assert ep.score == 0.0 and info["tests_restored"] == 1 and info["f2p_passed"] == 0
    # ... and it would have worked without the protection.
    ep = play(SweTask(protect_tests=False).make_env("train", 4), [cheat, "submit"])
    assert ep.score == 1.0 and ep.results[-1].info["tests_restored"] == 0
    # A fix with the tests deleted still scores: the tests are put back.
    ep = play(task.make_env("train", 4), [fix(bug), "run rm test_*.py", "submit"])
    assert ep.score == 1.0


def test_an_infinite_loop_in_a_test_fails_that_test_and_the_run_goes_on() -> None:
    task = SweTask(test_wall_s=4.0)
    bug = task.bug("train", 5)
    loop = f"replace {bug.module} return {bug.old} => while True:\n        pass"
    ep = play(task.make_env("train", 5), [loop, "submit"])
    info = ep.results[-1].info
    assert ep.score == 0.0 and info["test_status"] == "ok" and info["test_timeouts"] == 1
    assert info["p2p_passed"] == info["p2p_total"]  # the other tests still ran


def test_a_test_run_that_never_ends_is_a_recorded_timeout() -> None:
    task = SweTask(test_wall_s=1.0)
    bug = task.bug("train", 5)
    ep = play(task.make_env("train", 5), [f"run echo 'while 1: pass' >> {bug.module}", "submit"])
    info = ep.results[-1].info
    assert info["test_status"] == "timeout" and ep.score == 0.0
    assert solve(task, "train", 6).score == 1.0  # the next episode is unaffected


def test_fork_bomb_and_huge_files_are_stopped() -> None:
    task = SweTask(run_wall_s=2.0)
    bomb = "run f() { f | f; }; f"
    huge = "run head -c 100000000 /dev/zero > big.bin"
    bug = task.bug("train", 7)
    too_big = f"replace {bug.module} {bug.old} => {'1' * (1 << 20)}"
    ep = play(task.make_env("train", 7), [bomb, huge, too_big, "run ls -s big.bin", "submit"])
    bomb_obs, huge_obs, big_obs, size_obs = ep.observations[:4]
    assert isinstance(bomb_obs, str) and ("Cannot fork" in bomb_obs or "(stopped: " in bomb_obs)
    assert huge_obs == "File size limit exceeded\n(exit 153)"  # the shell's child, SIGXFSZ
    assert big_obs == "error: the file would exceed 1048576 bytes"
    assert isinstance(size_obs, str) and int(size_obs.split()[0]) <= 4 * 1024 + 8  # KiB
    assert ep.score == 0.0


# ---------------------------------------------------------------- grading


def test_reward_rule_hand_worked() -> None:
    # binary: all 2 F2P and all 4 P2P pass -> 1; one P2P breaks -> 0
    assert reward_of(2, 2, 4, 4, partial=False) == 1.0
    assert reward_of(2, 2, 3, 4, partial=False) == 0.0
    # partial: (1/2 F2P) * (3/4 P2P) = 0.375; nothing fixed -> 0 however many P2P pass
    assert reward_of(1, 2, 3, 4, partial=True) == pytest.approx(0.375)
    assert reward_of(0, 2, 4, 4, partial=True) == 0.0
    # no P2P tests: the factor is 1
    assert reward_of(1, 4, 0, 0, partial=True) == pytest.approx(0.25)


def test_results_are_read_from_runner_and_pytest_output() -> None:
    out = "\n".join(
        [
            "PASS test_a.py::test_x",
            "FAIL test_a.py::test_y: AssertionError",
            "tests/t.py::test_v PASSED                  [ 50%]",
            "PASSED tests/t.py::test_p",
            "FAILED tests/t.py::test_q - assert 1 == 2",
            "ERROR tests/t.py::test_e - ImportError",
            "XFAIL tests/t.py::test_xf - reason",
            "PASSED tests/t.py::test_both",
            "FAILED tests/t.py::test_both",
            "2 passed, 1 failed",
        ]
    )
    assert parse_results(out) == {
        "test_a.py::test_x": True,
        "test_a.py::test_y": False,
        "tests/t.py::test_v": True,
        "tests/t.py::test_p": True,
        "tests/t.py::test_q": False,
        "tests/t.py::test_e": False,
        "tests/t.py::test_xf": True,
        "tests/t.py::test_both": False,
    }


def test_partial_credit_in_an_episode() -> None:
    task = SweTask(partial_credit=True)
    index = next(i for i in range(50) if len(task.bug("train", i).problem.pass_to_pass) == 2)
    bug = task.bug("train", index)
    source = bug.problem.files[0][1].splitlines()
    other = next(i for i in (2, 4, 6) if i != bug.line and i <= len(source))
    breaks = f"edit {bug.module} {other} {other}\n    return None"
    ep = play(task.make_env("train", index), [fix(bug), breaks, "submit"])
    info = ep.results[-1].info
    assert (info["f2p_passed"], info["p2p_passed"], info["p2p_total"]) == (1, 1, 2)
    assert ep.score == pytest.approx(0.5)  # (1/1) * (1/2)


def test_the_turn_limit_and_an_unfinished_episode_are_graded() -> None:
    task = SweTask(max_turns=2)
    bug = task.bug("train", 8)
    ep = play(task.make_env("train", 8), [f"read {bug.module}", fix(bug)])
    assert ep.done and ep.score == 1.0 and ep.results[-1].info["test_status"] == "ok"
    env = task.make_env("train", 8)  # cut short by the agent loop: graded by score()

    async def one_step_then_score() -> float:
        await env.reset(0)
        await env.step(fix(bug))
        assert env.workspace.root is not None
        return env.score()  # as the agent loop calls it: inside the running loop

    assert asyncio.run(one_step_then_score()) == 1.0 and env.workspace.root is None
    assert env.score() == 1.0  # graded once


# ---------------------------------------------------------------- instances


def write_instance(tmp_path: Path) -> Path:
    repo = tmp_path / "repos" / "calc"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(
        "def add(a, b):\n    return a - b\n\n\ndef neg(a):\n    return -a\n"
    )
    (repo / "tests" / "test_calc.py").write_text(
        "from calc import neg\n\n\ndef test_neg():\n    assert neg(2) == -2\n"
    )
    patch = (
        "--- a/tests/test_calc.py\n+++ b/tests/test_calc.py\n@@ -1,5 +1,9 @@\n"
        "-from calc import neg\n+from calc import add, neg\n \n \n def test_neg():\n"
        "     assert neg(2) == -2\n+\n+\n+def test_add():\n+    assert add(2, 3) == 5\n"
    )
    row = {
        "instance_id": "tiny__calc-1",
        "repo": "tiny/calc",
        "snapshot": "repos/calc",
        "problem_statement": "add() subtracts instead of adding",
        "test_cmd": "python -m pytest -rA -q -p no:cacheprovider",
        "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_add"]),
        "PASS_TO_PASS": ["tests/test_calc.py::test_neg"],
        "test_patch": patch,
    }
    path = tmp_path / "instances.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path


def test_swe_bench_layout_instances(tmp_path: Path) -> None:
    path = write_instance(tmp_path)
    original = {p: p.read_bytes() for p in tmp_path.rglob("*.py")}
    task = SweTask(instances=str(path), eval_instances=str(path), test_wall_s=30.0)
    assert task.eval_size == 1 and task.problem("eval", 0).issue.startswith("add()")
    ep = play(
        task.make_env("eval", 0),
        ["read tests/test_calc.py", "replace calc.py a - b => a + b", "submit"],
    )
    assert "test_add" not in str(ep.observations[0])  # the test patch stays hidden
    info = ep.results[-1].info
    assert ep.score == 1.0, info
    assert (info["f2p_passed"], info["p2p_passed"], info["tests_restored"]) == (1, 1, 1)
    assert play(task.make_env("train", 0), ["submit"]).score == 0.0
    assert {p: p.read_bytes() for p in tmp_path.rglob("*.py")} == original


BAD_PATCH = "--- a/tests/test_calc.py\n+++ b/tests/test_calc.py\n@@ -9 +9 @@\n-x\n+y\n"


def test_bad_instance_files_are_named(tmp_path: Path) -> None:
    path = write_instance(tmp_path)
    row = json.loads(path.read_text())
    for change, message in [
        ({"snapshot": "nowhere", "repo": "x/y"}, "needs 'snapshot'"),
        ({"FAIL_TO_PASS": "[oops"}, "FAIL_TO_PASS is a string that is not a JSON list"),
        ({"test_patch": BAD_PATCH}, "does not apply"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({**row, **change}) + "\n")
        with pytest.raises(ValueError, match=message):
            SweTask(instances=str(bad), eval_instances=str(path))
    with pytest.raises(ValueError, match="synthetic problems only"):
        SweTask(instances=str(path), eval_instances=str(path)).demonstrations(1, seed=0)


# ---------------------------------------------------------------- state, clean-up


def test_state_round_trip_resumes_the_working_copy() -> None:
    task = SweTask()
    bug = task.bug("train", 9)

    async def go() -> tuple[float, float]:
        env = task.make_env("train", 9)
        await env.reset(0)
        await env.step(fix(bug))
        await env.step("run printf 'caf\\351' > notes.bin")
        state = json.loads(json.dumps(env.state_dict()))
        restored = task.make_env("train", 9)
        restored.load_state_dict(state)
        assert restored.state_dict() == state
        assert restored.workspace.root is not None
        assert (restored.workspace.root / "notes.bin").read_bytes() == b"caf\xe9"
        a, b = await env.step("submit"), await restored.step("submit")
        assert a == b
        return env.score(), restored.score()

    assert asyncio.run(go()) == (1.0, 1.0)
    with pytest.raises(ValueError, match="instance_id"):
        task.make_env("train", 10).load_state_dict(task.make_env("train", 9).state_dict())


def test_abandoned_and_closed_envs_leave_nothing(tmp_path: Path) -> None:
    before = leftovers()
    env: SweEnv | None = SweTask().make_env("train", 0)
    asyncio.run(env.reset(0))  # type: ignore[union-attr]
    assert len(leftovers() - before) == 1
    env = None
    gc.collect()
    assert leftovers() <= before
    other = SweTask().make_env("train", 1)
    asyncio.run(other.reset(0))
    other.close()
    assert leftovers() <= before


def test_demonstrations_show_each_tool_and_some_fail() -> None:
    demos = SweTask().demonstrations(120, seed=0)
    first = [m.content.split()[0] for d in demos for m in d if m.role == "assistant"]
    assert {"ls", "read", "replace", "edit", "test", "submit"} <= set(first)
    assert demos == SweTask().demonstrations(120, seed=0)
