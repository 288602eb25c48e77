"""``SweTask``: synthetic bug-fix problems, or the user's SWE-bench-layout
instances, and scripted demonstrations for the synthetic ones."""

from __future__ import annotations

import random

from sao.envs._split import draw_problem, split_of, stable_hash
from sao.envs._tools import Transcript
from sao.envs.base import Conversation, Split
from sao.envs.swe import _runner
from sao.envs.swe.env import SweEnv, SweOptions
from sao.envs.swe.grading import GradeLimits
from sao.envs.swe.instances import load_instances
from sao.envs.swe.problem import SweProblem
from sao.envs.swe.synthetic import FAMILIES, SyntheticBug
from sao.envs.swe.synthetic import draw_problem as draw_bug

__all__ = ["EVAL_SHARE", "SweTask"]

EVAL_SHARE = 10
"""One problem in ``EVAL_SHARE`` (by a hash of its text) is held out."""
PYTEST_CMD = "python -m pytest -rA -q -p no:cacheprovider"
FLAWS = ("ls", "wrong_file", "miscopy", "edit", "test", "wrong_fix", "wrong_fix_test", "give_up")


class SweTask:
    """Fix a small repository so its tests pass (``docs/environments.md``, ``swe``).

    Without ``instances``: synthetic repositories with one bug of
    ``families`` (:mod:`sao.envs.swe.synthetic`), deterministic from
    ``(seed, split, index)``, the eval split disjoint from train by problem
    text. With ``instances`` (a JSON/JSONL file, :mod:`sao.envs.swe.instances`):
    those problems; ``eval_instances`` is the held-out file, else one
    instance in ``EVAL_SHARE`` (by id) is held out. ``test_cmd`` is the
    instances' default test command.

    Episodes: ``max_turns`` replies, observations cut to ``obs_chars``,
    ``run``/``test`` commands stopped after ``run_wall_s``, grading after
    ``test_wall_s``; every sandbox run gets ``memory_mb``, ``disk_mb`` and
    ``allow_root``. ``protect_tests`` gives the test files their graded
    content before grading; ``partial_credit`` scores the share of tests
    fixed instead of all-or-nothing. ``error_rate`` is the share of
    demonstrations with a detour or a mistake. ``habit_rate`` is the share of
    the demonstrations of a ``habit_families`` bug (None: every family) with
    a systematic bad habit: replacing the buggy expression by another bug
    (``bug.wrong_new``) instead of the issue's fix, then submitting. Above
    one half, a warm-started policy copies the habit greedily while samples
    still fix some problems: a habit RL must unlearn (as the calculator's
    ``early_answer_rate``). ``system`` adds a system message describing the
    tools.
    """

    name = "swe"

    def __init__(
        self,
        *,
        seed: int = 0,
        families: tuple[str, ...] = FAMILIES,
        instances: str | None = None,
        eval_instances: str | None = None,
        test_cmd: str = PYTEST_CMD,
        max_turns: int = 8,
        obs_chars: int = 400,
        run_wall_s: float = 5.0,
        test_wall_s: float = 20.0,
        memory_mb: int = 512,
        disk_mb: int = 32,
        allow_root: bool = False,
        protect_tests: bool = True,
        partial_credit: bool = False,
        eval_size: int = 200,
        error_rate: float = 0.3,
        habit_rate: float = 0.0,
        habit_families: tuple[str, ...] | None = None,
        system: bool = False,
    ) -> None:
        bad = [f for f in families if f not in FAMILIES]
        _check(
            bool(families) and not bad, "families", f"use a non-empty subset of {list(FAMILIES)}"
        )
        _check(max_turns >= 2, "max_turns", "use 2 or more (an edit and submit)")
        _check(obs_chars >= 64, "obs_chars", "use 64 or more")
        _check(run_wall_s > 0 and test_wall_s > 0, "run_wall_s/test_wall_s", "use positive seconds")
        _check(eval_size >= 1, "eval_size", "use 1 or more")
        _check(0.0 <= error_rate <= 1.0, "error_rate", "use a value in [0, 1]")
        _check(0.0 <= habit_rate <= 1.0, "habit_rate", "use a value in [0, 1]")
        habit_families = tuple(families if habit_families is None else habit_families)
        _check(
            bool(habit_families) and set(habit_families) <= set(families),
            "habit_families",
            f"use a non-empty subset of families {list(families)}, or None for all",
        )
        self.seed, self.families = seed, tuple(families)
        self.error_rate = error_rate
        self.habit_rate, self.habit_families = habit_rate, habit_families
        self._eval_size = eval_size
        limits = GradeLimits(
            wall_s=test_wall_s, memory_mb=memory_mb, disk_mb=disk_mb, allow_root=allow_root
        )
        self.options = SweOptions(
            max_turns=max_turns,
            obs_chars=obs_chars,
            run_wall_s=run_wall_s,
            protect_tests=protect_tests,
            partial_credit=partial_credit,
            system=system,
            grading=limits,
        )
        self.instances: dict[Split, list[SweProblem]] | None = None
        if instances is not None:
            self.instances = _instance_splits(seed, instances, eval_instances, test_cmd)

    @property
    def eval_size(self) -> int:
        """Number of held-out problems."""
        return len(self.instances["eval"]) if self.instances else self._eval_size

    def split_of(self, text: str) -> Split:
        """The split a synthetic problem's text belongs to."""
        return split_of(self.seed, text, EVAL_SHARE)

    def bug(self, split: Split, index: int) -> SyntheticBug:
        """Synthetic problem ``index`` of ``split`` with its fix."""
        return draw_problem(
            self.seed,
            split,
            index,
            lambda rng: draw_bug(rng, self.families),
            lambda b: b.problem.text,
            EVAL_SHARE,
        )

    def problem(self, split: Split, index: int) -> SweProblem:
        """Problem ``index`` of ``split`` (the instances' train split wraps around)."""
        if self.instances is None:
            return self.bug(split, index).problem
        problems = self.instances[split]
        if split == "eval" and not 0 <= index < len(problems):
            raise IndexError(f"eval index {index} out of range [0, {len(problems)})")
        return problems[index % len(problems)]

    def make_env(self, split: Split, index: int) -> SweEnv:
        """A fresh environment for problem ``index`` of ``split``."""
        return SweEnv(self.problem(split, index), self.options)

    def demonstrations(self, n: int, *, seed: int) -> list[Conversation]:
        """``n`` scripted fixes of train problems; ``habit_rate`` of those of a
        ``habit_families`` bug make the habitual wrong fix, ``error_rate`` of
        the others take a detour (ls, the wrong file, a miscopied edit, a test
        run) or fail (a wrong fix, giving up). Synthetic problems only."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if self.instances is not None:
            raise ValueError(
                "SweTask.demonstrations: scripted fixes exist for the synthetic problems only; "
                "warm-start on your own transcripts for instances"
            )
        rng = random.Random(stable_hash(self.seed, "demos", seed))
        return [self._demo(rng) for _ in range(n)]

    def _demo(self, rng: random.Random) -> Conversation:
        index = rng.randrange(10**9)
        bug = self.bug("train", index)
        env = self.make_env("train", index)
        env.workspace.create()
        transcript = Transcript(env.first_messages())
        habit = rng.random() < self.habit_rate and bug.family in self.habit_families
        try:
            fixed = False
            actions = _habit_actions(bug) if habit else _demo_actions(bug, rng, self.error_rate)
            for action in actions:
                if action == "submit":
                    transcript.record(action, None)
                    break
                if action == "test":
                    transcript.record(action, _predicted_tests(bug, fixed))
                    continue
                transcript.record(action, env.observe(action))
                fixed = fixed or action.endswith(f"=> {bug.new}") or action.endswith(f" {bug.new}")
        finally:
            env.close()
        return transcript.conversation()


def _demo_actions(bug: SyntheticBug, rng: random.Random, error_rate: float) -> list[str]:
    """The scripted replies of one demonstration (see ``demonstrations``)."""
    path = bug.module
    read, fix = f"read {path}", f"replace {path} {bug.old} => {bug.new}"
    good = [read, fix, "submit"]
    if rng.random() >= error_rate:
        return good
    flaw = rng.choice(FLAWS)
    source = bug.problem.files[0][1]
    if flaw == "ls":
        return ["ls", *good]
    if flaw == "wrong_file":
        return [f"read test_{path}", *good]
    if flaw == "miscopy":
        bad = bug.old.replace(" ", "", 1) if " " in bug.old else bug.old + ")"
        return (
            good if bad in source else [read, f"replace {path} {bad} => {bug.new}", fix, "submit"]
        )
    if flaw == "edit":
        return [read, f"edit {path} {bug.line} {bug.line}\n    return {bug.new}", "submit"]
    if flaw == "test":
        return [read, fix, "test", "submit"]
    if flaw == "wrong_fix":
        return _habit_actions(bug)
    if flaw == "wrong_fix_test" and bug.wrong_new != bug.old:
        wrong = f"replace {path} {bug.old} => {bug.wrong_new}"
        return [read, wrong, "test", f"replace {path} {bug.wrong_new} => {bug.new}", "submit"]
    return [read, "submit"]


def _habit_actions(bug: SyntheticBug) -> list[str]:
    """Read, replace the bug by another bug (``bug.wrong_new``), submit: a
    wrong fix that looks like a fix (the ``wrong_fix`` flaw and the habit)."""
    path = bug.module
    return [f"read {path}", f"replace {path} {bug.old} => {bug.wrong_new}", "submit"]


def _predicted_tests(bug: SyntheticBug, fixed: bool) -> str:
    """The built-in runner's output for the repository as the demonstration
    left it: our own generated code, run here to name each test's error."""
    (_, source), (test_file, tests), _ = bug.problem.files
    if fixed:
        source = source.replace(bug.old, bug.new, 1)
    elif bug.wrong_new != bug.old:
        source = source.replace(bug.old, bug.wrong_new, 1)
    namespace: dict[str, object] = {}
    exec(source, namespace)
    exec(tests.split("\n", 1)[1], namespace)  # without its import line
    results = [
        (f"{test_file}::{k}", _error_of(v)) for k, v in namespace.items() if k.startswith("test_")
    ]
    return "\n".join(_runner.report_lines(results))


def _error_of(test: object) -> str | None:
    """The name of the exception ``test()`` raises, or None."""
    try:
        test()  # type: ignore[operator]
    except Exception as err:
        return type(err).__name__
    return None


def _instance_splits(
    seed: int, path: str, eval_path: str | None, test_cmd: str
) -> dict[Split, list[SweProblem]]:
    train = load_instances(path, default_test_cmd=test_cmd)
    if eval_path is not None:
        return {"train": train, "eval": load_instances(eval_path, default_test_cmd=test_cmd)}
    held = [split_of(seed, p.instance_id, EVAL_SHARE) == "eval" for p in train]
    evals = [p for p, h in zip(train, held, strict=True) if h]
    train = [p for p, h in zip(train, held, strict=True) if not h]
    _check(
        bool(evals) and bool(train),
        "eval_instances",
        "no instance fell in one split; give an eval file",
    )
    return {"train": train, "eval": evals}


def _check(ok: bool, option: str, fix: str) -> None:
    """Raise a ``ValueError`` naming ``option`` when ``ok`` is false."""
    if not ok:
        raise ValueError(f"SweTask option {option}: {fix}")
