"""Fixtures shared across test packages."""

from __future__ import annotations

from pathlib import Path

import pytest

from sao.models.tiny import build_tiny_policy
from sao.models.tokenization import build_char_tokenizer

pytest_plugins = ["tests.warm_starts"]  # warm starts built before the tests, once


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved 0.1M-parameter Llama with a character tokenizer over ``ab\\n``
    (what the toy SayA task needs), shared by the run-level tests."""
    path = tmp_path_factory.mktemp("policy")
    tokenizer = build_char_tokenizer(alphabet="ab\n")
    build_tiny_policy(tokenizer, size="0.1m", seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
