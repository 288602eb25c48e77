"""The builders the Ray backend (:mod:`sao.distributed`) calls, made from this
root's parts and engine factory: a rollout worker's task, engine and runner,
a trainer rank's models and trainer, the servers, the policy's device."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from sao.app.engines import (
    configured_servers,
    connect_servers,
    embedded_engine,
    model_device_type,
)
from sao.app.parts import (
    build_limits,
    build_task,
    load_critic,
    load_trained_policy,
    model_device,
    optim_settings,
    policy_path,
)
from sao.config import Config
from sao.distributed.builders import RankParts, RayBuilders
from sao.envs.base import Task
from sao.models.loading import load_config, load_policy, load_tokenizer, resolve_dtype
from sao.rollout.engine import Engine
from sao.runtime.runner import LocalRunner
from sao.train.sharded import init_trainer_group
from sao.train.trainer import Trainer

__all__ = ["RAY_BUILDERS", "build_rollout_worker", "build_trainer_rank"]


async def build_rollout_worker(
    cfg: Config, model_dir: str, task: Task | None, servers: Sequence[str], version: int
) -> tuple[LocalRunner, Engine]:
    """A rollout worker's runner and engine (on the worker's event loop): the
    task (``task``, or the configured one), the tokenizer, and the embedded
    engine or a router over the worker's share of the servers."""
    r = cfg.rollout
    task = task if task is not None else build_task(cfg)
    tokenizer = load_tokenizer(model_dir)
    engine: Engine
    if r.engine == "torch":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # in the dtypes a local run's engine takes (model.dtype, rollout.engine_dtype)
        policy = load_policy(model_dir, dtype=resolve_dtype(cfg.model.dtype, device))
        engine = embedded_engine(cfg, policy, tokenizer, version, device)
    else:
        engine = await connect_servers(
            cfg, servers, version, Path(model_dir), load_config(model_dir)
        )
    return LocalRunner(task, engine, tokenizer, build_limits(cfg)), engine


def build_trainer_rank(cfg: Config, start_dir: Path | None, role: str) -> RankParts:
    """Join the trainer group, load the model(s) of ``role`` (``both``,
    ``actor`` or ``critic``), shard them and build the optimizers."""
    device, dtype = model_device(cfg)
    # a dead peer makes the others fail after the timeout instead of hanging
    ranks = init_trainer_group(device, timeout_s=cfg.rollout.request_timeout_s)
    tokenizer = load_tokenizer(policy_path(cfg))
    policy = None if role == "critic" else load_trained_policy(cfg, start_dir, device, dtype)
    critic = None
    if role != "actor":
        # one process holds a LoRA actor's frozen base once for both models; sharded
        # ranks do not (each model's parameters become its own shards)
        share = policy if ranks.world_size == 1 else None
        critic = load_critic(cfg, start_dir, device, dtype, quiet=ranks.rank > 0, share_with=share)
    trainer = Trainer(policy, critic, cfg.algo.resolve(), optim_settings(cfg), ranks)
    return RankParts(tokenizer, trainer, dtype)


RAY_BUILDERS = RayBuilders(
    worker=build_rollout_worker,
    rank=build_trainer_rank,
    servers=configured_servers,
    device_type=model_device_type,
)
"""What ``runtime.backend = "ray"`` builds with."""
