"""Idle threads give back their OpenMP team: the workers really exit, results
do not change, and the embedded engine gives its team back when it idles and
its builder's when it starts."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

import sao.rollout.embedded.engine as engine_module
from sao.rollout.embedded.engine import TorchEngine
from sao.rollout.openmp import _libgomp_pauses, release_team, releasing
from sao.types import SamplingParams
from tests.rollout.embedded.test_engine import PROMPTS, build, generate_all


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settle(count: Callable[[], int], want: int, timeout_s: float = 5.0) -> int:
    """``count()`` once it equals ``want`` or the time is up (threads exit asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while (n := count()) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


@pytest.mark.skipif(not _libgomp_pauses(), reason="torch here does not run on GNU libgomp")
def test_release_team_ends_the_threads_workers_and_keeps_results() -> None:
    seen: dict[str, object] = {}
    x = torch.arange(1 << 22, dtype=torch.float32)

    def work() -> None:
        before = threads()
        first = (x * 2).sum()  # a parallel region: this thread's team is made
        seen["made"] = threads() - before
        seen["released"] = release_team()
        seen["after"] = settle(threads, before) - before
        seen["same"] = bool((x * 2).sum() == first)  # the team is made again on demand
        seen["again"] = threads() - before
        release_team()

    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        t = threading.Thread(target=work)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(saved)
    if seen["made"] == 0:
        pytest.skip("torch made no OpenMP worker for a 4M-element op here")
    assert seen == {"made": 1, "released": True, "after": 0, "same": True, "again": 1}


def test_releasing_releases_after_a_raise_too(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr("sao.rollout.openmp.release_team", lambda: calls.append("released"))

    def fails(n: int) -> int:
        raise ValueError(f"bad {n}")

    assert releasing(lambda n: n + 1)(1) == 2
    with pytest.raises(ValueError, match="bad 3"):
        releasing(fails)(3)
    assert calls == ["released", "released"]


def test_engine_gives_back_its_builders_team_and_its_own_when_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(
        engine_module, "release_team", lambda: calls.append(threading.current_thread().name)
    )
    params = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=0)]
    with TorchEngine(build("llama", seed=0), max_batch_size=2, max_seq_len=64) as engine:
        assert calls.count(threading.current_thread().name) == 1  # the builder's, once
        assert settle(lambda: calls.count("sao-torch-engine"), 1) == 1  # nothing to decode yet
        generate_all(engine, PROMPTS[:1], params)
        assert settle(lambda: calls.count("sao-torch-engine"), 2) == 2  # and idle again


KEEPS_THREADS = """
import os, time
import sao, torch
from sao.rollout.openmp import release_team
x = torch.arange(1 << 22, dtype=torch.float32)
torch.set_num_threads(2)
(x * 2).sum()
release_team()
time.sleep(0.1)
before = len(os.listdir("/proc/self/task"))
(x * 2).sum()
print(torch.get_num_threads(), len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.skipif(not _libgomp_pauses(), reason="torch here does not run on GNU libgomp")
def test_a_released_thread_keeps_its_torch_thread_count() -> None:
    """``torch.set_num_threads(2)`` against ``OMP_NUM_THREADS=1``: after the
    team is given back, the next region still has 2 threads, not the default 1."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", KEEPS_THREADS], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "1"]
