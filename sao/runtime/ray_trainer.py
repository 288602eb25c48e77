"""The trainer as a group of Ray actors (``runtime.backend = "ray"``):
``runtime.trainer_ranks`` ranks, each a :class:`TrainerRank` actor in its
own placement-group bundle, joined by ``torch.distributed`` (gloo on CPU,
NCCL on GPU) and training the actor and the colocated critic with FSDP2
(:mod:`sao.train.sharded`).

Every call is collective: the driver sends the same batch to every rank
(each picks its rows; denominators and advantages are global) and takes rank
0's metrics. Weights are gathered to rank 0 and handed to the rollout
workers as an object-store reference, never copied through the driver.
Checkpoints are sharded (``torch.distributed.checkpoint``, resumable on
another number of ranks) with the policy exported in Hugging Face format.

A rank that dies stops the run with :class:`TrainerRankError`, which says
to continue with ``--resume``.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import torch

from sao.config import Config, to_dict, validate
from sao.envs.base import Task
from sao.runtime.ray_backend import init_ray, place
from sao.types import SamplingParams, Trajectory

__all__ = ["RayTrainerGroup", "TrainerRank", "TrainerRankError"]


class TrainerRankError(RuntimeError):
    """A trainer rank died; the run stops (``sao train --resume RUN_DIR`` continues)."""


class TrainerRank:
    """One rank of the trainer (made a Ray actor by :meth:`RayTrainerGroup.start`)."""

    def __init__(self, cfg_dict: dict[str, Any], rank: int, world: int, master: str) -> None:
        host, port = master.rsplit(":", 1)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK="0",
            MASTER_ADDR=host,
            MASTER_PORT=port,
        )
        self.cfg = validate(cfg_dict)
        self.parts: Any = None
        self.dtype = torch.float32

    def start(self, start_dir: str | None, task: Task | None) -> int:
        """Join the group, load the models, shard them, build the optimizers."""
        from sao.models.device import resolve_device, resolve_dtype
        from sao.runtime.run import build_parts
        from sao.train.sharded import init_trainer_group

        device = resolve_device(self.cfg.model.device)
        # a dead peer makes the others fail after the timeout instead of hanging
        ranks = init_trainer_group(device, timeout_s=self.cfg.rollout.request_timeout_s)
        self.dtype = resolve_dtype(self.cfg.model.dtype, device)
        self.parts = build_parts(
            self.cfg,
            Path(start_dir) if start_dir else None,
            task,
            ranks=ranks,
            quiet=ranks.rank > 0,
        )
        return os.getpid()

    def step(self, trajectories: list[Trajectory], train_actor: bool) -> dict[str, float]:
        stats = self.parts.trainer.step(trajectories, train_actor=train_actor)
        return {k: float(v) for k, v in stats.items()}

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The full policy state dict on rank 0 (collective; None elsewhere)."""
        from sao.train.sharded import full_state_dict

        full = full_state_dict(self.parts.trainer.policy)
        return full if self.parts.trainer.ranks.is_main else None

    def score(self, trajectories: list[Trajectory], sampling: SamplingParams) -> Any:
        """The log-probability check on these trajectories (a collective forward
        through the sharded actor; its temperature is the sampling one)."""
        from sao.rollout.check import compare_logprobs
        from sao.types import collate

        scored = [t for t in trajectories if t.num_action_tokens > 0]
        trainer = self.parts.trainer
        pad = self.parts.tokenizer.pad_token_id or 0
        batch = collate(scored or trajectories, pad_id=int(pad))
        device = next(self.parts.policy.parameters()).device
        with torch.no_grad():
            logp = trainer.actor(batch.tokens_BT.to(device), batch.attention_mask_BT.to(device))
        return compare_logprobs(
            logp.float().cpu(),
            batch.rollout_logp_BT,
            batch.action_mask_BT,
            num_episodes=len(trajectories),
        )

    def export(self, directory: str) -> None:
        """The gathered policy and tokenizer in Hugging Face format (collective)."""
        from sao.train.sharded_checkpoint import save_pretrained_gathered

        trainer = self.parts.trainer
        save_pretrained_gathered(trainer.policy, Path(directory), trainer.ranks, dtype=self.dtype)
        if trainer.ranks.is_main:
            self.parts.tokenizer.save_pretrained(directory)

    def save(self, directory: str) -> None:
        """Sharded trainer state + the gathered Hugging Face policy (collective)."""
        from sao.train.sharded_checkpoint import save_pretrained_gathered, save_sharded

        d = Path(directory)
        trainer = self.parts.trainer
        save_sharded(d / "sharded", trainer)
        dtype = self.dtype  # (the shards are float32 masters; export as configured)
        save_pretrained_gathered(trainer.policy, d / "policy", trainer.ranks, dtype=dtype)
        if trainer.ranks.is_main:
            self.parts.tokenizer.save_pretrained(d / "policy")
        if trainer.critic is not None:
            save_pretrained_gathered(trainer.critic, d / "critic", trainer.ranks, dtype=dtype)

    def load(self, directory: str) -> None:
        from sao.train.sharded_checkpoint import load_sharded

        load_sharded(Path(directory) / "sharded", self.parts.trainer)

    def pid(self) -> int:
        return os.getpid()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RayTrainerGroup:
    """The driver's handle on the trainer ranks (duck-types ``Trainer.step``)."""

    def __init__(self, ray: Any, ranks: list[Any], pg: Any = None) -> None:
        self.ray, self.ranks, self.pg = ray, ranks, pg

    @classmethod
    async def start(cls, cfg: Config, start_dir: Path | None, task: Task | None) -> RayTrainerGroup:
        ray = init_ray(cfg)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        rt = cfg.runtime
        n = rt.trainer_ranks
        bundle = {"CPU": rt.cpus_per_rank} | ({"GPU": rt.gpus_per_rank} if rt.gpus_per_rank else {})
        pg = await place(ray, [dict(bundle) for _ in range(n)], f"{n} trainer ranks")
        master = f"{ray.util.get_node_ip_address()}:{_free_port()}"
        remote_cls = ray.remote(TrainerRank)
        actors = [
            remote_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i
                ),
                num_cpus=rt.cpus_per_rank,
                num_gpus=rt.gpus_per_rank,
            ).remote(to_dict(cfg), i, n, master)
            for i in range(n)
        ]
        group = cls(ray, actors, pg)
        await group._all("start", str(start_dir) if start_dir else None, task)
        return group

    async def _all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank at once; a dead rank stops the run."""
        calls = [getattr(a, method).remote(*args) for a in self.ranks]
        try:
            return list(await asyncio.gather(*calls))
        except self.ray.exceptions.RayActorError as err:
            raise TrainerRankError(
                f"a trainer rank died during {method} ({type(err).__name__}); the run stops. "
                "Continue from the last checkpoint with `sao train --resume RUN_DIR`"
            ) from err

    async def step(self, trajectories: list[Trajectory], train_actor: bool) -> dict[str, float]:
        return dict((await self._all("step", trajectories, train_actor))[0])

    async def weights(self) -> Any:
        """An object-store reference to rank 0's gathered policy state dict."""
        calls = [a.weights.remote() for a in self.ranks]
        try:
            await asyncio.gather(*calls[1:])
        except self.ray.exceptions.RayActorError as err:
            raise TrainerRankError(f"a trainer rank died while gathering weights ({err})") from err
        return calls[0]

    async def score(
        self, trajectories: list[Trajectory], sampling: SamplingParams, engine: Any = None
    ) -> Any:
        return (await self._all("score", trajectories, sampling))[0]

    async def save_models(self, directory: Path) -> None:
        await self._all("save", str(directory))

    def trainer_state(self) -> dict[str, object]:
        return {"sharded": True}  # the trainer's state is in the checkpoint's sharded/

    async def load(self, directory: Path) -> None:
        await self._all("load", str(directory))

    async def export(self, directory: Path) -> None:
        await self._all("export", str(directory))

    def close(self) -> None:
        for a in self.ranks:
            self.ray.kill(a)
        if self.pg is not None:  # give the bundles back to the cluster
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None
