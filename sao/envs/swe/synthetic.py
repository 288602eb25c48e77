"""Tiny synthetic repositories with one seeded bug each.

A repository is a module ``NAME.py`` of two or three one-line functions,
its tests ``test_NAME.py`` (one test function per function) and the
built-in runner ``run_tests.py`` (:mod:`sao.envs.swe._runner`). One function
carries a bug from a family:

* ``wrong_operator``: ``return x - y`` in ``add``;
* ``off_by_one``: ``return sum(range(n))`` in ``total`` (should include n);
* ``swapped_args``: ``return y - x`` in ``sub``;
* ``missing_edge_case``: ``return xs[0]`` in ``head`` (fails on ``[]``).

The issue names the file, the function, the buggy expression it returns and
the one it should (``calc.py: add(x, y) returns x - y; it should return x + y``),
so an exact replacement copied from the issue fixes it: ``replace calc.py
x - y => x + y``. The
buggy function's test is FAIL_TO_PASS, the others PASS_TO_PASS; the test
files and the runner are protected test files.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from sao.envs._split import stable_hash
from sao.envs.swe.problem import SweProblem

__all__ = ["FAMILIES", "RUNNER", "SyntheticBug", "draw_problem"]

RUNNER = Path(__file__).with_name("_runner.py").read_text()
"""The built-in test runner, copied into every synthetic repository."""
TEST_CMD = "python -I run_tests.py"
MODULES = ("calc", "mathx", "ops", "util", "nums", "core", "tools", "basic")
PAIRS = (("a", "b"), ("x", "y"), ("m", "n"), ("p", "q"), ("u", "v"))
SEQS = ("xs", "items", "vals", "nums")
COUNTS = ("n", "k")


@dataclass(frozen=True)
class _Template:
    """A one-line function: its name, argument kind, correct body, test
    asserts, and its bugs by family (``{a}``/``{b}``/``{s}``/``{n}`` are
    the argument names)."""

    name: str
    args: str
    body: str
    asserts: tuple[str, ...]
    bugs: dict[str, tuple[str, ...]]


TEMPLATES = (
    _Template(
        "add",
        "ab",
        "{a} + {b}",
        ("add(2, 3) == 5",),
        {"wrong_operator": ("{a} - {b}", "{a} * {b}")},
    ),
    _Template(
        "sub",
        "ab",
        "{a} - {b}",
        ("sub(5, 3) == 2",),
        {"wrong_operator": ("{a} + {b}",), "swapped_args": ("{b} - {a}",)},
    ),
    _Template(
        "mul",
        "ab",
        "{a} * {b}",
        ("mul(3, 4) == 12",),
        {"wrong_operator": ("{a} + {b}", "{a} ** {b}")},
    ),
    _Template(
        "div",
        "ab",
        "{a} / {b}",
        ("div(6, 3) == 2",),
        {"swapped_args": ("{b} / {a}",), "wrong_operator": ("{a} * {b}",)},
    ),
    _Template(
        "power",
        "ab",
        "{a} ** {b}",
        ("power(2, 3) == 8",),
        {"swapped_args": ("{b} ** {a}",), "wrong_operator": ("{a} * {b}",)},
    ),
    _Template(
        "total",
        "n",
        "sum(range({n} + 1))",
        ("total(4) == 10",),
        {"off_by_one": ("sum(range({n}))", "sum(range({n} - 1))")},
    ),
    _Template(
        "upto",
        "n",
        "list(range(1, {n} + 1))",
        ("upto(3) == [1, 2, 3]",),
        {"off_by_one": ("list(range(1, {n}))", "list(range({n}))")},
    ),
    _Template(
        "last",
        "s",
        "{s}[-1]",
        ("last([1, 2, 3]) == 3",),
        {"off_by_one": ("{s}[-2]", "{s}[len({s}) - 2]")},
    ),
    _Template(
        "head",
        "s",
        "{s}[0] if {s} else None",
        ("head([]) is None", "head([4, 5]) == 4"),
        {"missing_edge_case": ("{s}[0]",)},
    ),
    _Template(
        "mean",
        "s",
        "sum({s}) / len({s}) if {s} else 0",
        ("mean([]) == 0", "mean([2, 4]) == 3"),
        {"missing_edge_case": ("sum({s}) / len({s})",)},
    ),
    _Template(
        "biggest",
        "s",
        "max({s}) if {s} else None",
        ("biggest([]) is None", "biggest([1, 3]) == 3"),
        {"missing_edge_case": ("max({s})",)},
    ),
)
FAMILIES: tuple[str, ...] = ("wrong_operator", "off_by_one", "swapped_args", "missing_edge_case")


@dataclass(frozen=True)
class SyntheticBug:
    """A generated problem and what fixes it (for demonstrations and tests)."""

    problem: SweProblem
    module: str
    """The file with the bug, e.g. ``calc.py``."""
    function: str
    family: str
    old: str
    """The buggy expression (unique in the file)."""
    new: str
    """The correct expression (named in the issue)."""
    line: int
    """The 1-based line of the buggy ``return``."""
    wrong_new: str
    """A plausible but wrong fix: another of the family's bugs, else another of
    the function's (``b - a`` for ``a + b`` in ``sub``), else ``old`` (a no-op)."""


def _params(t: _Template, rng: random.Random) -> dict[str, str]:
    a, b = rng.choice(PAIRS)
    return {"a": a, "b": b, "s": rng.choice(SEQS), "n": rng.choice(COUNTS)}


def _signature(t: _Template, p: dict[str, str]) -> str:
    args = {"ab": f"{p['a']}, {p['b']}", "n": p["n"], "s": p["s"]}[t.args]
    return f"{t.name}({args})"


def draw_problem(rng: random.Random, families: tuple[str, ...]) -> SyntheticBug:
    """One repository with one bug of a family in ``families``."""
    while True:
        buggy = rng.choice([t for t in TEMPLATES if set(t.bugs) & set(families)])
        family = rng.choice(sorted(set(buggy.bugs) & set(families)))
        others = rng.sample([t for t in TEMPLATES if t is not buggy], rng.randint(1, 2))
        chosen = [buggy, *others]
        rng.shuffle(chosen)
        params = [_params(t, rng) for t in chosen]
        bug = _assemble(chosen, params, chosen.index(buggy), family, rng)
        if bug is not None:
            return bug


def _assemble(
    chosen: list[_Template], params: list[dict[str, str]], k: int, family: str, rng: random.Random
) -> SyntheticBug | None:
    """The repository for these functions with function ``k`` buggy, or None
    when the buggy expression is not unique in the file."""
    module = rng.choice(MODULES)
    t, p = chosen[k], params[k]
    options = [e.format(**p) for e in t.bugs[family]]
    old = rng.choice(options)
    new = t.body.format(**p)
    lines = []
    for i, (tt, pp) in enumerate(zip(chosen, params, strict=True)):
        lines += [
            f"def {_signature(tt, pp)}:",
            f"    return {old if i == k else tt.body.format(**pp)}",
        ]
    source = "\n".join(lines) + "\n"
    if source.count(old) != 1:
        return None
    names = ", ".join(tt.name for tt in chosen)
    tests = [f"from {module} import {names}"]
    for tt in chosen:
        tests += [f"def test_{tt.name}():", *(f"    assert {a}" for a in tt.asserts)]
    test_file = f"test_{module}.py"
    test_body = "\n".join(tests) + "\n"
    issue = f"{module}.py: {_signature(t, p)} returns {old}; it should return {new}"
    digest = stable_hash(issue, source, test_body)
    problem = SweProblem(
        instance_id=f"synthetic-{module}-{t.name}-{digest % 16**8:08x}",
        issue=issue,
        test_cmd=TEST_CMD,
        fail_to_pass=(f"{test_file}::test_{t.name}",),
        pass_to_pass=tuple(f"{test_file}::test_{tt.name}" for tt in chosen if tt is not t),
        files=((f"{module}.py", source), (test_file, test_body), ("run_tests.py", RUNNER)),
        test_files=((test_file, test_body), ("run_tests.py", RUNNER)),
    )
    # Another of the family's bugs, else another of the function's, else a no-op.
    others = [e.format(**p) for f in sorted(t.bugs, key=lambda f: f != family) for e in t.bugs[f]]
    wrong = [o for o in others if o != old] or [old]
    return SyntheticBug(problem, f"{module}.py", t.name, family, old, new, 2 * k + 2, wrong[0])
