"""``import sao`` shortens GNU OpenMP's barrier spin (sao/__init__.py) unless
the user set it: with libgomp's default (300,000 rounds), torch's two threads
on 2 cores, one of them busy in another session, trained 34x slower than on a
quiet machine; at sao's 10,000, 3.3x (benchmarks/spin.py)."""

from __future__ import annotations

import os
import subprocess
import sys

SHOW = "import sao, os; print(os.environ['GOMP_SPINCOUNT'])"


def spin_after_import(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_sao_sets_a_short_spin_and_keeps_the_users() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    assert spin_after_import(env) == "10000"
    assert spin_after_import(env | {"GOMP_SPINCOUNT": "300000"}) == "300000"


def test_the_tests_import_sao_before_torch() -> None:
    # a plain `pytest` gets sao's spin too: the first conftest imports sao first
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    cmd = [sys.executable, "-X", "importtime", "-c", "import tests.conftest"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # one line per module as its import finishes: a package before what it imports later
    done = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()]
    assert done.index("sao") < done.index("torch"), "torch was imported before sao"
