"""Grading a ``swe`` episode: the one place its reward is computed.

The final working copy is copied to a fresh directory; there every test file
of the problem gets its graded content (``protect_tests``: always, so editing
or deleting a test never helps; otherwise only where the policy left the
file as it was); the test command then runs in a fresh sandbox process
(:func:`sao.envs.sandbox.run_shell`, nothing written back) and its output is
read for per-test results:

* the built-in runner's lines ``PASS ID`` / ``FAIL ID: Error``;
* pytest's ``-rA`` summary lines ``PASSED ID`` / ``FAILED ID - ...`` /
  ``ERROR ID``, and its verbose lines ``ID PASSED``.

A test passes when some line says it passed (``PASS``, ``PASSED``,
``XFAIL``) and none that it failed; a test with no line counts as failed.
The reward (:func:`reward_of`) is binary by default: 1 iff every
FAIL_TO_PASS test passes and no PASS_TO_PASS test breaks. With partial
credit it is ``(f2p passed / f2p) * (p2p passed / p2p)`` (a factor is 1
when its list is empty), so doing nothing scores 0 and breaking half the
passing tests halves the credit. Timeouts and crashes of the test command
are reported in ``test_status``, never turned into a reward of their own.
"""

from __future__ import annotations

import math
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from sao.envs.sandbox import SandboxResult, run_shell
from sao.envs.sandbox.jail import copy_tree
from sao.envs.swe.problem import SweProblem

__all__ = ["Grade", "GradeLimits", "grade", "parse_results", "reward_of"]

_PREFIX = re.compile(r"^(PASS|PASSED|XFAIL|FAIL|FAILED|ERROR|XPASS)\s+(\S+?)(?::)?(?:\s|$)")
_SUFFIX = re.compile(r"^(\S+::\S+)\s+(PASSED|XFAIL|FAILED|ERROR|XPASS)\b")
_PASSING = ("PASS", "PASSED", "XFAIL")
_STATUS = {"timeout": "timeout", "sandbox_error": "sandbox_error"}


@dataclass(frozen=True)
class GradeLimits:
    """Limits of the grading run (see :func:`sao.envs.sandbox.run_shell`)."""

    wall_s: float = 20.0
    memory_mb: int = 512
    disk_mb: int = 32
    file_size_mb: int = 4
    max_processes: int = 32
    allow_root: bool = False


@dataclass(frozen=True)
class Grade:
    """The outcome of grading one episode."""

    reward: float
    test_status: str
    """``ok`` (the test command finished and reported results; its exit
    status does not matter), ``timeout``, ``crashed:REASON`` (a sandbox limit
    or a signal stopped it, or it failed with ``exit N`` without reporting a
    result), ``no_results`` (it exited 0 without a test line), ``sandbox_error``."""
    f2p_passed: int
    f2p_total: int
    p2p_passed: int
    p2p_total: int
    tests_restored: int
    """Test files that had to be given their graded content (edited or
    deleted by the policy, or added by the problem's test patch)."""
    test_timeouts: int = 0
    """Tests the built-in runner stopped at its per-test time limit."""

    def info(self) -> dict[str, int | float | str]:
        """The grade as ``StepResult.info`` entries."""
        return dict(asdict(self))


def reward_of(
    f2p_passed: int, f2p_total: int, p2p_passed: int, p2p_total: int, *, partial: bool
) -> float:
    """The reward for these counts (module docstring)."""
    f2p = f2p_passed / f2p_total if f2p_total else 1.0
    p2p = p2p_passed / p2p_total if p2p_total else 1.0
    if partial:
        return f2p * p2p
    return 1.0 if f2p == 1.0 and p2p == 1.0 else 0.0


def parse_results(output: str) -> dict[str, bool]:
    """Test id -> passed, from a test command's output (module docstring)."""
    seen: dict[str, bool] = {}
    for line in output.splitlines():
        line = line.strip()
        m = _PREFIX.match(line)
        status, node = (m.group(1), m.group(2)) if m else (None, None)
        if m is None and (s := _SUFFIX.match(line)):
            node, status = s.group(1), s.group(2)
        if node is None or status is None:
            continue
        seen[node] = seen.get(node, True) and status in _PASSING
    return seen


def _place_tests(problem: SweProblem, workdir: Path, gdir: Path, protect: bool) -> int:
    """Give the test files in ``gdir`` their graded content; returns how many changed."""
    changed = 0
    for rel, body in problem.test_files:
        current = workdir / rel
        now = None if current.is_symlink() or not current.is_file() else current.read_bytes()
        want = None if body is None else body.encode()
        if now == want:
            continue
        if not protect and now != problem.original(rel):
            continue  # the policy's own version of the test stays
        changed += 1
        _clear_way(gdir, rel)
        if want is not None:
            (gdir / rel).write_bytes(want)
    return changed


def _clear_way(root: Path, rel: str) -> None:
    """Make ``root / rel`` writable as a plain file inside ``root``: remove
    links and non-directories on the way and whatever is at the end."""
    here = root
    for part in Path(rel).parts[:-1]:
        here = here / part
        if here.is_symlink() or (here.exists() and not here.is_dir()):
            here.unlink()
        here.mkdir(exist_ok=True)
    target = root / rel
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    elif target.is_symlink() or target.exists():
        target.unlink()


def _status(result: SandboxResult, results: dict[str, bool]) -> str:
    reason = result.killed_reason
    if reason in _STATUS:
        return _STATUS[reason]
    if reason is not None and reason != "leftover_processes":
        return f"crashed:{reason}"
    if results:
        return "ok"
    return "no_results" if result.exit_code == 0 else f"crashed:exit {result.exit_code}"


async def grade(
    problem: SweProblem, workdir: Path, *, protect_tests: bool, partial: bool, limits: GradeLimits
) -> Grade:
    """Run the problem's tests on a copy of ``workdir`` and score them."""
    gdir = Path(tempfile.mkdtemp(prefix="sao-swe-grade-"))
    try:
        copy_tree(str(workdir), str(gdir))
        restored = _place_tests(problem, workdir, gdir, protect_tests)
        try:
            result = await run_shell(
                problem.test_cmd,
                gdir,
                wall_s=limits.wall_s,
                cpu_s=math.ceil(limits.wall_s) + 1,  # a busy loop meets the deadline first
                memory_mb=limits.memory_mb,
                disk_mb=limits.disk_mb,
                file_size_mb=limits.file_size_mb,
                max_processes=limits.max_processes,
                max_output_chars=200_000,
                allow_root=limits.allow_root,
                write_back=False,
            )
        except (OSError, ValueError):  # the sandbox could not run (e.g. the copy is too big)
            f2p, p2p = len(problem.fail_to_pass), len(problem.pass_to_pass)
            return Grade(0.0, "sandbox_error", 0, f2p, 0, p2p, restored)
    finally:
        shutil.rmtree(gdir, ignore_errors=True)
    results = parse_results(result.stdout + "\n" + result.stderr)
    f2p = sum(results.get(t, False) for t in problem.fail_to_pass)
    p2p = sum(results.get(t, False) for t in problem.pass_to_pass)
    totals = len(problem.fail_to_pass), len(problem.pass_to_pass)
    reward = reward_of(f2p, totals[0], p2p, totals[1], partial=partial)
    timeouts = sum(ln.endswith(": Timeout") for ln in result.stdout.splitlines())
    return Grade(
        reward, _status(result, results), f2p, totals[0], p2p, totals[1], restored, timeouts
    )
