"""The trainer as a group of Ray actors (``runtime.backend = "ray"``):
``runtime.trainer_ranks`` ranks, each a :class:`TrainerRank` actor in its
own placement-group bundle, joined by ``torch.distributed`` (gloo on CPU,
NCCL on GPU) and training the actor and the colocated critic with FSDP2
(:mod:`sao.train.sharded`). With ``runtime.critic_ranks`` = N > 0 the critic
is a second group of N ranks (its own process group), loading only the
critic, and the step is split between the groups (:mod:`sao.train.groups`):
the critic's targets, then its K updates while the actor updates.

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
from sao.distributed.backend import init_ray, place
from sao.distributed.builders import RankBuilder
from sao.distributed.shared import SharedState, to_shared
from sao.runtime.memory import give_back_freed
from sao.train.groups import merge_stats
from sao.types import SamplingParams, Trajectory

__all__ = ["RayTrainerGroup", "TrainerRank", "TrainerRankError"]


class TrainerRankError(RuntimeError):
    """A trainer rank died; the run stops (``sao train --resume RUN_DIR`` continues)."""


class TrainerRank:
    """One rank of the trainer (made a Ray actor by :meth:`RayTrainerGroup.start`).
    ``role``: ``both`` (actor and colocated critic), ``actor`` or ``critic`` (the
    two groups of ``runtime.critic_ranks``, each loading only its model)."""

    def __init__(
        self,
        cfg_dict: dict[str, Any],
        rank: int,
        world: int,
        master: str,
        build: RankBuilder,
        role: str = "both",
    ) -> None:
        host, port = master.rsplit(":", 1)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK="0",
            MASTER_ADDR=host,
            MASTER_PORT=port,
        )
        self.cfg = validate(cfg_dict)
        self.role, self.build = role, build
        self.trainer: Any = None
        self.tokenizer: Any = None
        self.pending: Any = None  # the critic's targets between its two halves of a step
        self.weight_group: Any = None  # rank 0's end of the servers' weight-transfer group
        self.dtype = torch.float32

    def node(self) -> tuple[str, int]:
        """This rank's Ray node and the cores it may use there."""
        import ray

        return ray.get_runtime_context().get_node_id(), len(os.sched_getaffinity(0))

    def start(self, start_dir: str | None, threads: int) -> int:
        """Join the group, load the model(s) of this role, shard them, build the
        optimizers; torch computes with ``threads`` threads (Ray would cap it at
        the bundle's whole CPUs: 1 for a 0.5-CPU rank). Returns the thread count."""
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # (for the processes it starts)
        built = self.build(self.cfg, Path(start_dir) if start_dir else None, self.role)
        self.tokenizer, self.trainer, self.dtype = built.tokenizer, built.trainer, built.dtype
        return torch.get_num_threads()

    def step(self, trajectories: list[Trajectory], train_actor: bool) -> dict[str, float]:
        stats = _floats(self.trainer.step(trajectories, train_actor=train_actor))
        if self.cfg.train.release_memory:
            give_back_freed()  # (sao.runtime.memory: freed pages back to the kernel)
        return stats

    def critic_targets(self, trajectories: list[Trajectory], train_actor: bool) -> Any:
        """The critic group's first half of a step: the actor's advantages (rank 0's)."""
        from sao.train.groups import critic_targets

        adv, self.pending = critic_targets(self.trainer, trajectories, train_actor=train_actor)
        return adv if self.trainer.ranks.is_main else None

    def critic_update(self) -> dict[str, float]:
        """The critic group's second half: its K updates on the targets it kept."""
        from sao.train.groups import critic_update

        pending, self.pending = self.pending, None
        return _floats(critic_update(self.trainer, pending))

    def actor_update(self, trajectories: list[Trajectory], advantages: Any) -> Any:
        """The actor group's step on the critic group's advantages (None: the
        critic's values were NaN/inf, nothing trains this step)."""
        from sao.train.groups import actor_update

        if advantages is None:
            return None
        return _floats(actor_update(self.trainer, trajectories, advantages))

    def weights(self) -> SharedState | None:
        """The full policy state dict on rank 0 (collective; None elsewhere), as
        arrays the workers map from the object store without copying; for a LoRA
        policy, the adapted modules' merged weights only (and, for servers, the
        siblings their fused layers need: :func:`~sao.models.lora.published_state`)."""
        state = self._update()
        return None if state is None else to_shared(state)

    def _update(self) -> dict[str, torch.Tensor] | None:
        from sao.train.sharded_checkpoint import gathered_update

        fused = self.cfg.rollout.engine != "torch"
        return gathered_update(self.trainer.policy, self.trainer.ranks, fused=fused)

    # -------------------------------------------- broadcast to the servers (rank 0 sends)

    def weight_endpoint(self) -> tuple[str, int]:
        """Where servers reach this rank for a weight-transfer group: its node's
        address and a free port there."""
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def open_weight_group(self, group: Any) -> dict[str, list[object]] | None:
        """Rank 0 hosts ``group`` (blocks until every server joined); returns
        what each version's tensors are (collective: one gather on every rank)."""
        from sao.rollout.remote.collective import describe

        if self.trainer.ranks.is_main:
            group.open()
            self.weight_group = group
        full = self._sendable()
        return describe(full) if full is not None else None

    def send_weights(self) -> None:
        """Gather the policy (collective) and broadcast it from rank 0 over the
        weight-transfer group while the servers receive."""
        full = self._sendable()
        if full is not None:
            self.weight_group.send(full)

    def _sendable(self) -> dict[str, torch.Tensor] | None:
        from sao.train.sharded_checkpoint import cast_floating

        full = self._update()  # float32 masters when sharded: send in the model's dtype
        return None if full is None else cast_floating(full, self.dtype)

    def score(self, trajectories: list[Trajectory], sampling: SamplingParams) -> Any:
        """The log-probability check on these trajectories (a collective forward
        through the sharded actor; its temperature is the sampling one)."""
        from sao.rollout.check import compare_logprobs
        from sao.types import collate

        scored = [t for t in trajectories if t.num_action_tokens > 0]
        trainer = self.trainer
        pad = self.tokenizer.pad_token_id or 0
        batch = collate(scored or trajectories, pad_id=int(pad))
        device = trainer.device
        with torch.no_grad():
            logp = trainer.actor(batch.tokens_BT.to(device), batch.attention_mask_BT.to(device))
        return compare_logprobs(
            logp.float().cpu(),
            batch.rollout_logp_BT,
            batch.action_mask_BT,
            num_episodes=len(trajectories),
        )

    def turn_values(self, trajectories: list[Trajectory]) -> list[list[float]]:
        """The critic's value at the start of each turn (a collective forward of the critic)."""
        from sao.train.critic_fit import turn_values

        return turn_values(self.trainer, trajectories)

    def export(self, directory: str) -> None:
        """The gathered policy and tokenizer in Hugging Face format (collective)."""
        from sao.train.sharded_checkpoint import save_pretrained_gathered

        trainer = self.trainer
        save_pretrained_gathered(
            trainer.policy, Path(directory), trainer.ranks, dtype=self.dtype, export=True
        )
        if trainer.ranks.is_main:
            self.tokenizer.save_pretrained(directory)

    def save(self, directory: str) -> None:
        """This group's sharded state (``sharded/``, or ``sharded_critic/`` for a
        critic of its own) + its gathered Hugging Face model(s) (collective)."""
        from sao.train.sharded_checkpoint import save_pretrained_gathered, save_sharded

        d = Path(directory)
        trainer = self.trainer
        save_sharded(d / ("sharded_critic" if self.role == "critic" else "sharded"), trainer)
        dtype = self.dtype  # (the shards are float32 masters; export as configured)
        if trainer.policy is not None:
            save_pretrained_gathered(trainer.policy, d / "policy", trainer.ranks, dtype=dtype)
            if trainer.ranks.is_main:
                self.tokenizer.save_pretrained(d / "policy")
        if trainer.critic is not None:
            save_pretrained_gathered(trainer.critic, d / "critic", trainer.ranks, dtype=dtype)

    def load(self, directory: str) -> None:
        """Restore this group's part of a checkpoint, whichever layout wrote it
        (a critic of its own or colocated, any number of ranks)."""
        from sao.train.sharded_checkpoint import load_sharded

        d = Path(directory)
        own = d / "sharded_critic"
        load_sharded(d / "sharded", self.trainer, own if (own / ".metadata").is_file() else None)

    def pid(self) -> int:
        return os.getpid()


def _floats(stats: dict[str, Any]) -> dict[str, float]:
    """Metrics as plain floats (0-dim CPU tensors do not cross to the driver as numbers)."""
    return {k: float(v) for k, v in stats.items()}


def rank_threads(configured: int, nodes: list[tuple[str, int]], rank: int) -> int:
    """Torch threads for trainer ``rank``: ``configured``, or (0) the cores of
    its node shared evenly among the ranks placed there (as the local trainer
    uses every core). ``nodes``: each rank's (node id, cores usable there)."""
    if configured > 0:
        return configured
    node, cores = nodes[rank]
    return max(1, cores // sum(1 for n, _ in nodes if n == node))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


DEATH_GRACE_S = 30.0
"""How long a failed call waits for the other ranks' outcomes, for a death
that Ray reports after the survivors' errors."""


async def _first_error(
    futures: list[asyncio.Future[Any]], kind: type[BaseException]
) -> BaseException | None:
    """The first of ``futures``' errors of type ``kind``, once each has ended
    or :data:`DEATH_GRACE_S` has passed (those still running are left alone)."""
    await asyncio.wait(futures, timeout=DEATH_GRACE_S)
    for f in futures:
        if f.done() and not f.cancelled() and isinstance(f.exception(), kind):
            return f.exception()
    return None


class RayTrainerGroup:
    """The driver's handle on the trainer ranks (duck-types ``Trainer.step``):
    ``ranks`` train the actor (and the colocated critic); ``critics``, when
    ``runtime.critic_ranks`` > 0, are the critic's own group."""

    def __init__(
        self, ray: Any, ranks: list[Any], pg: Any = None, critics: list[Any] | None = None
    ) -> None:
        self.ray, self.ranks, self.pg = ray, ranks, pg
        self.critics = critics or []

    @classmethod
    async def start(
        cls, cfg: Config, start_dir: Path | None, build: RankBuilder
    ) -> RayTrainerGroup:
        """Place and start the ranks; each joins the group and builds what it
        trains with ``build`` (:data:`sao.app.distributed.RAY_BUILDERS`' ``rank``)."""
        ray = init_ray(cfg)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        rt = cfg.runtime
        n, c = rt.trainer_ranks, rt.critic_ranks
        bundle = {"CPU": rt.cpus_per_rank} | ({"GPU": rt.gpus_per_rank} if rt.gpus_per_rank else {})
        what = f"{n} trainer ranks" + (f" and {c} critic ranks" if c else "")
        pg = await place(ray, [dict(bundle) for _ in range(n + c)], what)
        remote_cls = ray.remote(TrainerRank)
        ip = ray.util.get_node_ip_address()

        def group(first: int, size: int, role: str) -> list[Any]:
            master = f"{ip}:{_free_port()}"
            return [
                remote_cls.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=first + i
                    ),
                    num_cpus=rt.cpus_per_rank,
                    num_gpus=rt.gpus_per_rank,
                ).remote(to_dict(cfg), i, size, master, build, role)
                for i in range(size)
            ]

        actors = group(0, n, "actor" if c else "both")
        critics = group(n, c, "critic") if c else []
        handle = cls(ray, actors, pg, critics)
        everyone = actors + critics
        nodes = await handle._wait([a.node.remote() for a in everyone], "start")
        start = str(start_dir) if start_dir else None
        calls = [
            a.start.remote(start, rank_threads(rt.threads_per_rank, nodes, i))
            for i, a in enumerate(everyone)
        ]
        threads = await handle._wait(calls, "start")
        print(f"trainer: {what}, torch threads {threads}")
        return handle

    async def _all(self, method: str, *args: Any, group: list[Any] | None = None) -> list[Any]:
        """Call ``method`` on every rank of ``group`` (default: the actor's) at
        once; a dead rank stops the run."""
        ranks = self.ranks if group is None else group
        return await self._wait([getattr(a, method).remote(*args) for a in ranks], method)

    async def _wait(self, calls: list[Any], method: str, *, also: Any = None) -> list[Any]:
        """The calls' results. A dead rank is a :class:`TrainerRankError`, also
        when a surviving rank's error comes first: its collective fails as soon
        as the peer's socket closes, often before Ray reports the death.
        ``also``: a call not waited for whose death counts too (looked at only
        after a failure)."""
        futures = [asyncio.ensure_future(c) for c in calls]
        try:
            return list(await asyncio.gather(*futures))
        except Exception as err:
            dead = self.ray.exceptions.RayActorError
            if not isinstance(err, dead) and also is not None:
                futures.append(asyncio.ensure_future(also))
            died = err if isinstance(err, dead) else await _first_error(futures, dead)
            if died is None:
                raise
            raise TrainerRankError(
                f"a trainer rank died during {method} ({type(died).__name__}); the run stops. "
                "Continue from the last checkpoint with `sao train --resume RUN_DIR`"
            ) from died

    async def step(self, trajectories: list[Trajectory], train_actor: bool) -> dict[str, float]:
        if not self.critics:
            return dict((await self._all("step", trajectories, train_actor))[0])
        # the critic's targets first; then its K updates and the actor's update at once
        batch = self.ray.put(trajectories)  # one copy in the object store for both groups
        targets = [c.critic_targets.remote(batch, train_actor) for c in self.critics]
        updates = [c.critic_update.remote() for c in self.critics]  # (in order, per actor)
        actor = (
            [a.actor_update.remote(batch, targets[0]) for a in self.ranks] if train_actor else []
        )
        done = await self._wait(targets + updates + actor, "step")
        critic_stats = done[len(targets)]
        actor_stats = done[2 * len(targets)] if actor else None
        return merge_stats(critic_stats, actor_stats)

    async def weights(self) -> Any:
        """An object-store reference to rank 0's gathered policy state dict."""
        calls = [a.weights.remote() for a in self.ranks]
        await self._wait(calls[1:], "the weights' gathering", also=calls[0])
        return calls[0]

    async def new_weight_group(self, world_size: int, backend: str, timeout_s: float) -> Any:
        """A weight-transfer group hosted by rank 0 for ``world_size - 1`` server
        ranks, not yet open: pass it to the servers, then :meth:`host_weight_group`."""
        from sao.rollout.remote.collective import WeightGroup

        host, port = (await self._wait([self.ranks[0].weight_endpoint.remote()], "setup"))[0]
        return WeightGroup(host, port, world_size, backend=backend, timeout_s=timeout_s)

    async def host_weight_group(self, group: Any) -> dict[str, list[object]]:
        """Rank 0 opens ``group`` (returns when every server joined); what each
        version's tensors are (names, dtypes, shapes)."""
        return (await self._all("open_weight_group", group))[0]

    async def send_weights(self) -> None:
        """One version broadcast from rank 0 (the servers must receive meanwhile)."""
        await self._all("send_weights")

    async def score(
        self, trajectories: list[Trajectory], sampling: SamplingParams, engine: Any = None
    ) -> Any:
        return (await self._all("score", trajectories, sampling))[0]

    async def turn_values(self, trajectories: list[Trajectory]) -> list[list[float]]:
        group = self.critics or self.ranks  # (the critic's own ranks when it has them)
        return (await self._all("turn_values", trajectories, group=group))[0]

    async def save_models(self, directory: Path) -> None:
        everyone = self.ranks + self.critics  # (each group writes its own part)
        await self._wait([a.save.remote(str(directory)) for a in everyone], "save")

    def trainer_state(self) -> dict[str, object]:
        return {"sharded": True}  # the trainer's state is in the checkpoint's sharded/

    async def load(self, directory: Path) -> None:
        everyone = self.ranks + self.critics
        await self._wait([a.load.remote(str(directory)) for a in everyone], "load")

    async def export(self, directory: Path) -> None:
        await self._all("export", str(directory))

    def close(self) -> None:
        for a in self.ranks + self.critics:
            self.ray.kill(a)
        if self.pg is not None:  # give the bundles back to the cluster
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None
