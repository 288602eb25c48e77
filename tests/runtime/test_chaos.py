"""Chaos: a tiny calc-tiny run is killed with SIGKILL at random points, aimed
in turn at a training step, a checkpoint write, start-up, an evaluation and
the final export, and resumed each time until it finishes; its ledger shows
that no trajectory was trained twice and none that finished before a
checkpoint was lost (``scripts/chaos.py``; its 20-kill version is in
BENCHMARKS.md)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.mark.slow
def test_sigkill_anywhere_loses_nothing_and_trains_nothing_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the attempts import it by name too
    chaos = importlib.import_module("chaos")
    lines: list[str] = []
    result = chaos.chaos(tmp_path, kills=5, seed=0, steps=8, timeout_s=240, say=lines.append)
    report = "\n".join([*lines, result.summary()])
    assert result.problems == [], report
    assert len(result.kills) == 5, report
    assert result.attempts == 6 and result.steps == 9, report  # 1 critic warm-up + 8 actor steps
    assert result.resumed >= 3, report  # the kills after the first one come after a checkpoint
