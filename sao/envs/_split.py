"""Seeded, disjoint train/eval problem streams shared by the built-in tasks."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import TypeVar

from sao.envs.base import Split

P = TypeVar("P")

MAX_ATTEMPTS = 10_000


def stable_hash(*parts: object) -> int:
    """A stable 64-bit hash of ``parts`` (independent of PYTHONHASHSEED)."""
    data = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def split_of(seed: int, text: str, eval_share: int) -> Split:
    """The split a problem text belongs to: one text in ``eval_share`` is held out."""
    return "eval" if stable_hash(seed, "split", text) % eval_share == 0 else "train"


def draw_problem(
    seed: int,
    split: Split,
    index: int,
    draw: Callable[[random.Random], P],
    text_of: Callable[[P], str],
    eval_share: int,
) -> P:
    """Problem ``index`` of ``split``: the first hashed candidate ``draw(rng)`` whose
    text belongs to that split, so no eval problem text ever appears in train."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    for attempt in range(MAX_ATTEMPTS):
        candidate = draw(random.Random(stable_hash(seed, split, index, attempt)))
        if split_of(seed, text_of(candidate), eval_share) == split:
            return candidate
    raise ValueError(f"no {split} problem found in {MAX_ATTEMPTS} draws")
