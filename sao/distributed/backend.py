"""The Ray backend (``runtime.backend = "ray"``): rollout workers are Ray
actors that own their engines and run the environments where the episode
runs; the orchestrator (gate, buffer, asyncio loop) stays in the driver.

```
 driver: Orchestrator ── RayRunner.run(split, index) ──► RolloutWorker i (Ray actor)
            │                                             task.make_env + run_episode
            │  publish(v): weights once into the           on its own engine (embedded,
            └─ object store (or a weight directory) ──►   or its share of the servers)
```

- Placement: one placement group, a bundle of ``runtime.cpus_per_worker``
  CPUs (and ``runtime.gpus_per_worker`` GPUs) per worker; the cluster is
  checked first and a shortfall is an error that says what is missing.
  ``runtime.ray_address`` joins an existing cluster; otherwise a local one is
  started with this machine's CPUs.
- Weights: every worker with an embedded engine gets the same object-store
  reference (one copy, however many workers); workers that drive servers get
  the weight directory the driver wrote (each server is driven by exactly one
  worker: servers are dealt round-robin).
- Failure: a worker that dies is replaced in its bundle, given the current
  weights, and the episodes it was running are played again from the start
  on a live worker; the run goes on (``workers/replaced`` counts them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sao.config import Config, ConfigError, to_dict, validate
from sao.distributed.builders import DeviceType, RayBuilders, WorkerBuilder
from sao.distributed.shared import from_shared, to_shared
from sao.envs.base import Split, Task
from sao.rollout.remote.router import NoLiveEngineError
from sao.rollout.resume import EpisodeResume
from sao.runtime.memory import give_back_freed
from sao.types import SamplingParams, Trajectory

logger = logging.getLogger(__name__)
Publish = Callable[[int], Awaitable[float]]

__all__ = ["RayRunner", "RolloutWorker", "init_ray", "start_workers"]


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "runtime.backend=ray needs Ray: pip install 'sao[ray]' (or pip install 'ray[default]')"
        ) from None
    return ray


def init_ray(cfg: Config) -> Any:
    """Join ``runtime.ray_address``, or start a local cluster; returns the module."""
    ray = _ray()
    if ray.is_initialized():
        return ray
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    path = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p and os.path.isdir(p))
    runtime_env = {"env_vars": {"PYTHONPATH": path, "RAY_AUTH_MODE": "disabled"}}
    address = cfg.runtime.ray_address
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if address is None:
        kwargs["num_cpus"] = os.cpu_count() or 1
    ray.init(address=address, runtime_env=runtime_env, **kwargs)
    return ray


async def place(
    ray: Any, bundles: list[dict[str, float]], what: str, timeout_s: float = 120
) -> Any:
    """A placement group of ``bundles`` once it is ready; an error naming what
    the cluster lacks (in all, or free now) when it cannot be placed."""
    from ray.util.placement_group import placement_group, remove_placement_group

    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    check_resources(ray, need, what)
    pg = placement_group(bundles, strategy="PACK")
    try:
        await asyncio.wait_for(pg.ready(), timeout_s)
    except asyncio.TimeoutError:
        remove_placement_group(pg)
        free = ray.available_resources()
        detail = ", ".join(f"{k}: asks for {v:g}, {free.get(k, 0):g} free" for k, v in need.items())
        raise ConfigError(
            f"the Ray cluster could not place {what} within {timeout_s:.0f} s ({detail}); other "
            "jobs hold its resources: free them or lower the runtime.* counts"
        ) from None
    return pg


def check_resources(ray: Any, need: Mapping[str, float], what: str) -> None:
    """Raise ConfigError naming what the cluster lacks for ``need``."""
    have = ray.cluster_resources()
    missing = [
        f"{k}: asks for {v:g}, the cluster has {have.get(k, 0):g}"
        for k, v in need.items()
        if v > have.get(k, 0) + 1e-9
    ]
    if missing:
        raise ConfigError(
            f"the Ray cluster is too small for {what} ({'; '.join(missing)}); lower the "
            "runtime.* counts or per-actor resources, or add nodes"
        )


class RolloutWorker:
    """A rollout worker (made a Ray actor by :func:`start_workers`): one task,
    one engine (embedded, or a router over its share of the servers)."""

    def __init__(
        self,
        cfg_dict: dict[str, Any],
        model_dir: str,
        task: Task | None,
        servers: Sequence[str],
        version: int,
        build: WorkerBuilder,
    ) -> None:
        self.cfg = validate(cfg_dict)
        self.model_dir, self.task_obj, self.servers = model_dir, task, list(servers)
        self.version = version
        self.build = build
        self.runner: Any = None
        self.engine: Any = None
        self.weight_group: Any = None  # the servers' weight-transfer group (broadcast)

    async def start(self) -> int:
        """Build the task, tokenizer and engine (on the worker's event loop)."""
        self.runner, self.engine = await self.build(
            self.cfg, self.model_dir, self.task_obj, self.servers, self.version
        )
        return os.getpid()

    async def run(
        self,
        split: Split,
        index: int,
        seed: int,
        prompt_id: str,
        group_id: str,
        sampling: SamplingParams,
        resume: EpisodeResume | None = None,
    ) -> Trajectory:
        return await self.runner.run(
            split,
            index,
            seed=seed,
            prompt_id=prompt_id,
            group_id=group_id,
            sampling=sampling,
            resume=resume,
        )

    async def take_resumes(self, keys: list[str]) -> dict[str, EpisodeResume]:
        return await self.runner.take_resumes(keys)

    async def update_weights(self, weights: Any, version: int) -> float:
        """Apply a state dict (resolved from the object store) or a weight
        directory path; returns the seconds it took here."""
        from sao.rollout.weights import DiskWeights, TensorWeights

        t0 = time.perf_counter()
        if isinstance(weights, str):
            await self.engine.update_weights(DiskWeights(Path(weights), version))
        else:  # (a SharedState is read in place from the object store)
            await self.engine.update_weights(TensorWeights(from_shared(weights), version))
        del weights
        if self.cfg.train.release_memory:  # freed pages (a directory's tensors) back
            give_back_freed()
        self.version = version
        return time.perf_counter() - t0

    async def join_weight_group(self, group: Any, first_rank: int | None) -> None:
        """This worker's servers join ``group`` as ranks ``first_rank``.. (a Ray
        trainer rank hosts it); None: they joined already (a replacement worker)."""
        self.weight_group = group
        if first_rank is not None:
            await self.engine.join_weight_group(group, first_rank, host=False)

    async def receive_weights(self, info: dict[str, list[object]], version: int) -> float:
        """This worker's servers receive version ``version`` while the trainer's
        rank 0 broadcasts it (``info``: names, dtypes, shapes); returns the seconds."""
        from sao.rollout.remote.collective import meta_state
        from sao.rollout.weights import BroadcastWeights

        t0 = time.perf_counter()
        source = BroadcastWeights(meta_state(info), version, self.weight_group, send=False)
        await self.engine.update_weights(source)
        self.version = version
        return time.perf_counter() - t0

    def set_train_step(self, step: int) -> None:
        self.runner.set_train_step(step)

    def eval_size(self) -> int:
        return int(self.runner.eval_size)

    def pid(self) -> int:
        return os.getpid()

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.aclose()


@dataclass
class _Slot:
    actor: Any
    bundle: int
    servers: list[str]
    outstanding: int = 0


@dataclass
class RayRunner:
    """The driver's :class:`~sao.runtime.runner.EpisodeRunner` over rollout workers."""

    ray: Any
    slots: list[_Slot]
    make_actor: Any  # (bundle, servers, version) -> actor handle
    eval_size: int
    version: int = 0
    weights: Any = None  # the last published weights (object ref or directory)
    train_step: int | None = None
    replaced: int = 0
    pg: Any = None
    weight_group: Any = None  # set when weights are broadcast to the servers
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def run(
        self,
        split: Split,
        index: int,
        *,
        seed: int,
        prompt_id: str,
        group_id: str,
        sampling: SamplingParams,
        resume: EpisodeResume | None = None,
    ) -> Trajectory:
        while True:
            slot = min(self.slots, key=lambda s: s.outstanding)
            slot.outstanding += 1
            actor = slot.actor
            try:
                return await actor.run.remote(
                    split, index, seed, prompt_id, group_id, sampling, resume
                )
            except self.ray.exceptions.RayActorError as err:
                await self._replace(slot, actor, err)
            finally:
                slot.outstanding -= 1

    async def _replace(self, slot: _Slot, dead: Any, err: BaseException) -> None:
        """Start a new worker in the dead one's bundle, with the current weights."""
        async with self._lock:
            if slot.actor is not dead:  # another episode already replaced it
                return
            logger.warning("rollout worker %d died (%s); starting a new one", slot.bundle, err)
            actor = self.make_actor(slot.bundle, slot.servers, self.version)
            await actor.start.remote()
            if self.weight_group is not None:  # its servers are in the group, at self.version
                await actor.join_weight_group.remote(self.weight_group, None)
            elif self.weights is not None:
                await actor.update_weights.remote(self.weights, self.version)
            if self.train_step is not None:
                await actor.set_train_step.remote(self.train_step)
            slot.actor = actor
            self.replaced += 1

    async def publish(self, weights: Any, version: int) -> None:
        """Send ``weights`` (an object-store reference, a state dict, put once
        in the object store, or a weight directory path) to every worker."""
        is_ref = isinstance(weights, (str, self.ray.ObjectRef))
        ref = weights if is_ref else self.ray.put(to_shared(weights))
        self.weights, self.version = ref, version
        calls = [s.actor.update_weights.remote(ref, version) for s in self.slots]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for slot, result in zip(self.slots, results, strict=True):
            if isinstance(result, self.ray.exceptions.RayActorError):
                await self._replace(slot, slot.actor, result)
            elif isinstance(result, BaseException):
                raise result

    async def join_weight_group(self, group: Any) -> None:
        """Every worker's servers join ``group``, ranked in worker order from 1
        (rank 0 is the trainer's, which opens it meanwhile)."""
        self.weight_group = group
        firsts = [1 + sum(len(s.servers) for s in self.slots[:i]) for i in range(len(self.slots))]
        calls = [
            s.actor.join_weight_group.remote(group, f)
            for s, f in zip(self.slots, firsts, strict=True)
        ]
        await asyncio.gather(*calls)

    async def receive_broadcast(self, info: dict[str, list[object]], version: int) -> None:
        """Every worker's servers receive ``version`` (the trainer sends meanwhile).
        A worker that dies here stops the run: the broadcast needs all of its ranks."""
        calls = [s.actor.receive_weights.remote(info, version) for s in self.slots]
        try:
            await asyncio.gather(*calls)
        except self.ray.exceptions.RayActorError as err:
            raise NoLiveEngineError(
                f"a rollout worker died during a weight broadcast ({type(err).__name__}), and a "
                "broadcast needs every server: continue with `sao train --resume RUN_DIR`, or "
                "use rollout.weight_transfer=disk to survive it"
            ) from err
        self.version = version

    async def take_resumes(self, keys: list[str]) -> dict[str, EpisodeResume]:
        """Snapshots of the episodes ``keys`` from whichever worker runs them."""
        calls = [s.actor.take_resumes.remote(keys) for s in self.slots]
        out: dict[str, EpisodeResume] = {}
        for got in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(got, dict):  # a dead worker's episodes restart from scratch
                out |= got
        return out

    def metrics(self) -> dict[str, float]:
        return {"workers/replaced": float(self.replaced), "workers/count": float(len(self.slots))}

    def set_train_step(self, step: int) -> None:
        self.train_step = step
        for s in self.slots:
            s.actor.set_train_step.remote(step)

    async def close(self) -> None:
        await asyncio.gather(*(s.actor.close.remote() for s in self.slots), return_exceptions=True)
        for s in self.slots:
            self.ray.kill(s.actor)
        if self.pg is not None:  # give the bundles back to the cluster
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)


async def start_workers(
    cfg: Config,
    model_dir: str,
    task: Task | None,
    servers: Sequence[str],
    version: int,
    build: WorkerBuilder,
) -> RayRunner:
    """Place and start ``runtime.rollout_workers`` workers (each builds its
    runner and engine with ``build``); returns the runner."""
    ray = init_ray(cfg)
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    rt = cfg.runtime
    n = rt.rollout_workers
    bundle = {"CPU": rt.cpus_per_worker} | (
        {"GPU": rt.gpus_per_worker} if rt.gpus_per_worker else {}
    )
    pg = await place(ray, [dict(bundle) for _ in range(n)], f"{n} rollout workers")
    remote_cls = ray.remote(RolloutWorker)
    cfg_dict = to_dict(cfg)

    def make_actor(i: int, share: list[str], v: int) -> Any:
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        opts = {"num_cpus": rt.cpus_per_worker, "num_gpus": rt.gpus_per_worker}
        return remote_cls.options(scheduling_strategy=strategy, **opts).remote(
            cfg_dict, model_dir, task, share, v, build
        )

    shares = [list(servers[i::n]) for i in range(n)]
    if servers and any(not s for s in shares):
        raise ConfigError(
            f"{n} rollout workers but {len(servers)} servers: each worker drives its own "
            "servers, so give at least as many servers as runtime.rollout_workers"
        )
    slots = [_Slot(make_actor(i, shares[i], version), i, shares[i]) for i in range(n)]
    await asyncio.gather(*(s.actor.start.remote() for s in slots))
    eval_size = await slots[0].actor.eval_size.remote()
    return RayRunner(ray, slots, make_actor, int(eval_size), version=version, pg=pg)


@contextlib.asynccontextmanager
async def open_ray_rollout(
    cfg: Config,
    policy: torch.nn.Module,
    trainer: Any,
    model_dir: Path,
    run_dir: Path,
    version: int,
    task: Task | None,
    builders: RayBuilders,
) -> AsyncIterator[tuple[RayRunner, Publish]]:
    """Rollout workers (and any servers they drive) for a run, and the
    function that publishes the trainer's weights to them; torn down on exit.
    ``trainer``: the :class:`~sao.distributed.trainer.RayTrainerGroup`, whose
    ``weights()`` gives an object-store reference to the policy's state dict
    and whose rank 0 hosts the broadcast to the servers
    (``rollout.weight_transfer=broadcast``); ``policy`` is only read for its
    config and device. ``builders``: the composition root's
    (:data:`sao.app.distributed.RAY_BUILDERS`)."""
    from sao.rollout.weights import write_weights

    r = cfg.rollout
    weights_dir = Path(r.weights_dir) if r.weights_dir else run_dir / "weights"
    async with contextlib.AsyncExitStack() as stack:
        urls = await stack.enter_async_context(
            builders.servers(cfg, policy, model_dir, run_dir)  # type: ignore[arg-type]
        )
        runner = await start_workers(cfg, str(model_dir), task, urls, version, builders.worker)
        stack.push_async_callback(runner.close)
        if r.weight_transfer == "broadcast":
            publish = await _broadcast_publish(
                cfg, policy, trainer, runner, len(urls), builders.device_type
            )
            await publish(version)  # the servers sample with the trainer's weights from here on
            yield runner, publish
            return

        async def publish(v: int) -> float:
            t0 = time.perf_counter()
            ref = await trainer.weights()
            if r.engine == "torch":  # every worker resolves the same object-store copy
                payload: Any = ref
            else:  # servers read a directory: write it once here
                state = from_shared(ref if isinstance(ref, dict) else await ref)
                src = await asyncio.to_thread(
                    write_weights, state, weights_dir, v, config=getattr(policy, "config", None)
                )
                payload = str(src.path)
            await runner.publish(payload, v)
            return time.perf_counter() - t0

        await publish(version)  # workers sample with the trainer's weights from here on
        yield runner, publish


async def _broadcast_publish(
    cfg: Config,
    policy: torch.nn.Module,
    trainer: Any,
    runner: RayRunner,
    servers: int,
    device_type: DeviceType,
) -> Publish:
    """Set up the weight-transfer group (the trainer's rank 0 hosts it, every
    server joins through the worker that drives it) and return ``publish``:
    rank 0 broadcasts each version while the workers' servers receive it."""
    backend = "nccl" if device_type(cfg, policy) == "cuda" else "gloo"
    group = await trainer.new_weight_group(1 + servers, backend, cfg.rollout.request_timeout_s)
    info, _ = await asyncio.gather(
        trainer.host_weight_group(group), runner.join_weight_group(group)
    )

    async def publish(v: int) -> float:
        t0 = time.perf_counter()
        await asyncio.gather(trainer.send_weights(), runner.receive_broadcast(info, v))
        return time.perf_counter() - t0

    return publish
