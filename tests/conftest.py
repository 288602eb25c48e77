"""Fixtures shared across test packages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# sao before torch, so that its GOMP_SPINCOUNT default (sao/__init__.py) reaches
# torch's OpenMP threads for a plain `pytest` too (make test also exports it)
from sao.models.tiny import build_tiny_policy
from sao.models.tokenization import build_char_tokenizer

pytest_plugins = ["tests.warm_starts", "pytester"]  # (warm starts built before the tests, once)

if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    # `pytest -n N`: the N workers share the cores, so each (and every process a
    # test starts) gets its share of torch threads, not N times the cores
    import torch

    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved 0.1M-parameter Llama with a character tokenizer over ``ab\\n``
    (what the toy SayA task needs), shared by the run-level tests."""
    path = tmp_path_factory.mktemp("policy")
    tokenizer = build_char_tokenizer(alphabet="ab\n")
    build_tiny_policy(tokenizer, size="0.1m", seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
