"""Warm starts are announced when built, and built before the tests, never
inside one (tests/warm_starts.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import sao.app.warmstart as warmstart
from sao.app.warmstart import WarmStartRecipe, build_notice, ensure_policy
from tests import warm_starts

# 8 demonstrations, one epoch of one batch: a real build of the 0.1M or 1M
# model in about a second.
QUICK = WarmStartRecipe(demos=8, epochs=1, batch_size=8, max_len=128)


@pytest.fixture
def quick_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache of this test's own, and a calculator recipe that builds quickly."""
    monkeypatch.setenv("SAO_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(warmstart.RECIPES, "calculator", QUICK)
    return tmp_path / "home"


def test_the_notice_says_what_where_and_how_long(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("SAO_HOME", raising=False)
    assert build_notice("calculator") == (
        "building the calculator task's warm-started policy "
        "(once, then cached in ~/.cache/sao; about 70 s on 2 idle cores, longer on busy ones) ..."
    )
    monkeypatch.setenv("SAO_HOME", str(tmp_path))
    # no measured time for the dataset task, nor for a size other than 1m
    want = f"building the dataset task's warm-started policy (once, then cached in {tmp_path}) ..."
    assert build_notice("dataset") == want
    assert "about" not in build_notice("calculator", "0.1m")


def test_a_build_is_announced_with_its_time_and_a_cached_policy_is_not(quick_home: Path) -> None:
    lines: list[str] = []
    path = ensure_policy("calculator", {}, size="0.1m", progress=False, say=lines.append)
    assert path.is_relative_to(quick_home) and (path / "warmstart.json").is_file()
    assert lines[0] == build_notice("calculator", "0.1m")
    assert len(lines) == 2
    assert re.fullmatch(r"built the calculator task's warm-started policy in \d+\.\d s", lines[1])
    assert ensure_policy("calculator", {}, size="0.1m", say=lines.append) == path
    assert len(lines) == 2  # cached: nothing said


def test_the_session_build_writes_one_line_each(quick_home: Path) -> None:
    out: list[str] = []
    assert warm_starts.build("calc-tiny", out.append) is None
    line = "".join(out)
    notice = re.escape(f"calc-tiny: {build_notice('calculator')} ")
    assert re.fullmatch(notice + r"\d+\.\d s\n", line), line
    out.clear()
    assert warm_starts.build("calc-tiny", out.append) is None
    (line,) = out
    assert line.startswith("calc-tiny's warm-started policy: cached in ")
    assert str(quick_home) in line


def test_a_failed_session_build_is_reported(
    quick_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = WarmStartRecipe(demos=8, epochs=1, batch_size=0)
    monkeypatch.setitem(warmstart.RECIPES, "calculator", bad)
    out: list[str] = []
    error = warm_starts.build("calc-tiny", out.append)
    assert error == "ValueError: sft: batch_size must be an int >= 1, got 0"
    assert re.search(r" \.\.\. failed after \d+\.\d s: ValueError\(", "".join(out))
    assert list((quick_home / "models" / "policy").iterdir()) == []  # no half-built policy


def test_a_test_never_builds_a_warm_start_in_the_shared_cache() -> None:
    # seed 987654 has no cached policy; the guard stops the build before it starts
    with pytest.raises(AssertionError, match=r"mark it @pytest\.mark\.warm_start\(PRESET\)"):
        ensure_policy("calculator", {"seed": 987654}, progress=False)


@dataclass
class _Item:
    marks: list[pytest.Mark]

    def iter_markers(self, name: str) -> list[pytest.Mark]:
        return [m for m in self.marks if m.name == name]


def test_only_the_selected_tests_presets_are_built() -> None:
    a = pytest.mark.warm_start("calc-tiny").mark
    b = pytest.mark.warm_start("guess-tiny", "calc-tiny").mark
    items = [_Item([pytest.mark.slow.mark]), _Item([a]), _Item([b, pytest.mark.slow.mark])]
    assert warm_starts.needed(items) == ["calc-tiny", "guess-tiny"]  # type: ignore[arg-type]
    assert warm_starts.needed(items[:1]) == []  # type: ignore[arg-type]


XDIST_CONFTEST = """
import sao.app.warmstart as warmstart
from sao.app.warmstart import WarmStartRecipe

warmstart.RECIPES["calculator"] = WarmStartRecipe(demos=8, epochs=1, batch_size=8, max_len=128)
warmstart.RECIPES["guess_number"] = WarmStartRecipe(demos=8, epochs=1, batch_size=0)  # fails
pytest_plugins = ["tests.warm_starts"]
"""

XDIST_TESTS = """
import pytest
from sao.app.warmstart import policy_dir
from tests.warm_starts import preset_args


@pytest.mark.warm_start("calc-tiny")
@pytest.mark.parametrize("k", range(4))
def test_calc(k):
    task, options, size, seed = preset_args("calc-tiny")
    assert policy_dir(task, options, size=size, seed=seed).is_dir()


@pytest.mark.warm_start("guess-tiny")
def test_guess():
    pass
"""


def test_under_xdist_the_controller_builds_once_before_any_test(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("xdist")
    monkeypatch.setenv("SAO_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))
    pytester.makeconftest(XDIST_CONFTEST)
    pytester.makepyfile(test_xdist_build=XDIST_TESTS)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    out = result.stdout.str()
    # one line each, on the controller's terminal, before the first result
    built = re.findall(r"^calc-tiny: building .* \d+\.\d s$", out, re.M)
    failed = re.findall(r"^guess-tiny: building .* failed after \d+\.\d s: ValueError", out, re.M)
    assert len(built) == 1 and len(failed) == 1, out
    assert out.index(built[0]) < out.index(failed[0]) < out.index("[100%]")
    # the workers ran their tests on the cached policy; the failed build fails its test
    result.assert_outcomes(passed=4, errors=1)
    assert "guess-tiny's warm start failed to build before the tests: ValueError" in out
