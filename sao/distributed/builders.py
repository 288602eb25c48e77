"""What the Ray backend builds with but does not own: the composition root
(:data:`sao.app.distributed.RAY_BUILDERS`) hands these builders in, so
``sao.distributed`` never imports ``sao.app``. They are module-level
functions, which Ray pickles by reference into the actors that call them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sao.config import Config
from sao.envs.base import Task
from sao.rollout.engine import Engine
from sao.runtime.runner import LocalRunner
from sao.train.trainer import Trainer

__all__ = ["RankParts", "RayBuilders"]


@dataclass(frozen=True)
class RankParts:
    """What one trainer rank trains with: the tokenizer, the trainer over the
    model(s) of its role, and the models' dtype."""

    tokenizer: PreTrainedTokenizerBase
    trainer: Trainer
    dtype: torch.dtype


WorkerBuilder = Callable[
    [Config, str, Task | None, Sequence[str], int], Awaitable[tuple[LocalRunner, Engine]]
]
"""``(cfg, model_dir, task, servers, version)``: a rollout worker's runner and
engine, built inside its actor (``task`` None: the configured one)."""
RankBuilder = Callable[[Config, Path | None, str], RankParts]
"""``(cfg, start_dir, role)``: join the trainer group and load what a rank of
``role`` (``both``, ``actor`` or ``critic``) trains, inside its actor."""
ServerOpener = Callable[
    [Config, PreTrainedModel, Path, Path], AbstractAsyncContextManager[list[str]]
]
"""``(cfg, policy, model_dir, run_dir)``: the servers' URLs, for as long as the
context lasts (``rollout.servers``, or ``rollout.launch`` servers started)."""
DeviceType = Callable[[Config, torch.nn.Module], str]
"""``(cfg, policy)``: where the policy computes (``cpu``, ``cuda``)."""


@dataclass(frozen=True)
class RayBuilders:
    """The builders the Ray backend calls (see the module docstring)."""

    worker: WorkerBuilder
    rank: RankBuilder
    servers: ServerOpener
    device_type: DeviceType
