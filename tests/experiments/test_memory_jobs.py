"""`sao experiment --jobs N` keeps runs that would not fit in memory together
apart: each run says its expected peak, a run started beside others learns what
they will still claim, and one that fits only alone waits for one to end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sao.app.memory import MemoryBusy, MemoryEstimate, check_memory
from sao.config import ConfigError, load_config
from sao.experiments.runner import _Job, _pool
from sao.runtime.memory import (
    ESTIMATE_FILE_ENV,
    MEMORY_BUSY_EXIT,
    RESERVED_ENV,
    publish_expected_peak,
    reserved_bytes,
)

GIB = 2**30


def test_a_run_that_fits_only_alone_is_busy_not_refused() -> None:
    est = MemoryEstimate({"runtime": 1 * GIB, "activations": 5 * GIB}, 4, 2)  # 6 GiB
    # 10 GiB available, 3 of them claimed by the runs beside it: 7 left, it fits
    line = check_memory(est, 10 * GIB, enforce=True, reserved=3 * GIB)
    assert "10.0 GiB available, 3.0 GiB of it claimed by the runs beside this one" in line
    # 5 claimed: 5 left < 6, but 6 <= 10 alone: it waits (exit 75), no keys to change
    with pytest.raises(MemoryBusy, match=r"need 6.0 GiB.*claim 5.0 GiB.*waits") as e:
        check_memory(est, 10 * GIB, enforce=True, reserved=5 * GIB)
    assert e.value.exit_code == MEMORY_BUSY_EXIT == 75
    # more than the machine has even alone: the plain refusal that names the keys
    with pytest.raises(ConfigError, match=r"train\.token_budget") as e2:
        check_memory(est, 5 * GIB, enforce=True, reserved=1 * GIB)
    assert not isinstance(e2.value, MemoryBusy)
    assert "claimed" in check_memory(est, 10 * GIB, enforce=False, reserved=5 * GIB)


def test_publish_and_read_the_protocol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    publish_expected_peak(123)  # unset: nothing written anywhere
    peak = tmp_path / "run.peak"
    monkeypatch.setenv(ESTIMATE_FILE_ENV, str(peak))
    publish_expected_peak(6.5 * GIB)
    assert peak.read_text() == str(int(6.5 * GIB))
    publish_expected_peak(None)
    assert peak.read_text() == "unknown" and not Path(f"{peak}.tmp").exists()
    assert reserved_bytes() == 0.0
    monkeypatch.setenv(RESERVED_ENV, "1024")
    assert reserved_bytes() == 1024.0


# A: says it will peak at 1 TiB, then holds on until B has run once.
_A = """
import os, pathlib, sys, time
time.sleep(0.5)  # loading its models: B must not start before A has said its peak
pathlib.Path(os.environ["SAO_EXPECTED_PEAK_FILE"]).write_text(str(2**40))
while not pathlib.Path(sys.argv[1]).exists():
    time.sleep(0.05)
"""
# B: records what it was told is claimed; busy (75) while anything is.
_B = """
import os, pathlib, sys
reserved = int(os.environ["SAO_MEMORY_RESERVED"])
with open(sys.argv[1], "a") as f:
    f.write(f"{reserved}\\n")
if reserved:
    pathlib.Path(sys.argv[2]).touch()  # lets A end
    sys.exit(75)
"""


def test_jobs_wait_for_the_peak_then_for_memory(tmp_path: Path) -> None:
    flag, told = tmp_path / "b-ran", tmp_path / "told"
    a = _Job(
        "A", [sys.executable, "-c", _A, str(flag)], tmp_path / "a.log", None, tmp_path / "a.peak"
    )
    b_cmd = [sys.executable, "-c", _B, str(told), str(flag)]
    b = _Job("B", b_cmd, tmp_path / "b.log", None, tmp_path / "b.peak")
    said: list[str] = []
    assert _pool([a, b], 2, said.append) == []  # nothing failed
    first, second = (int(x) for x in told.read_text().split())
    # B started only after A said 1 TiB, and was told 1 TiB less what A's process
    # held (a Python interpreter: well under 1 GiB)
    assert 2**40 - GIB < first < 2**40
    assert second == 0  # started again once A had ended, with nothing beside it
    # A's end and B's busy exit may be seen in either order; B's second run is last
    assert "B: waits for memory, until a run beside it ends" in said and len(said) == 3
    assert any(s.startswith("A: done") for s in said) and said[-1].startswith("B: done")


def test_a_busy_run_leaves_no_run_directory(
    tiny_policy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sao train` beside runs that claim all but 1 MiB of a 64 GiB machine: it
    fits alone, so it waits (MemoryBusy, exit 75), leaving nothing behind; alone,
    it says its expected peak before anything trains."""
    from sao.app import run

    monkeypatch.setattr(run, "available_bytes", lambda device: 64.0 * GIB)
    run_dir, peak = tmp_path / "run", tmp_path / "run.peak"
    cfg = load_config(overrides=[f"model.path={tiny_policy}", f"log.run_dir={run_dir}"])
    monkeypatch.setenv(RESERVED_ENV, str(64 * GIB - 2**20))
    monkeypatch.setenv(ESTIMATE_FILE_ENV, str(peak))
    with pytest.raises(MemoryBusy):
        run.train(cfg)
    assert not run_dir.exists() and not peak.exists()

    async def no_training(*args: object) -> int:
        return 0

    monkeypatch.setattr(run, "_run", no_training)
    monkeypatch.setenv(RESERVED_ENV, "0")
    run.train(cfg)
    assert 0 < int(peak.read_text()) < 64 * GIB
