"""Many engines behind one :class:`~sao.rollout.engine.Engine`.

- Affinity: every generation of one episode goes to the same engine, so its
  history stays in that engine's prefix cache. The episode is the one named by
  :data:`episode_key` (``run_episode`` sets it for the duration of an
  episode); a call outside an episode goes to the least busy engine.
- Balance: a new episode goes to the live engine with the fewest outstanding
  requests.
- Versions: :meth:`update_weights` applies every version to every live
  engine (concurrently) before it returns.
- Failure: an engine whose request raises :class:`EngineError` (dead,
  unreachable, hung past its request timeout) is marked dead and the
  generation is retried from the same prompt on another live engine; the
  episode goes on, and every token still carries the version that sampled it.
  With no live engine left, :class:`NoLiveEngineError` stops the run.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, cast

from sao.rollout.engine import Engine, episode_key
from sao.rollout.remote.collective import WeightGroup
from sao.rollout.remote.http_engine import EngineError
from sao.rollout.weights import BroadcastWeights, WeightSource
from sao.types import Completion, SamplingParams

__all__ = ["EngineRouter", "NoLiveEngineError", "episode_key"]

logger = logging.getLogger(__name__)

MAX_AFFINITIES = 65536


class NoLiveEngineError(RuntimeError):
    """Every engine of the router has failed."""


class EngineRouter:
    """Routes generations over ``engines`` (see the module docstring)."""

    def __init__(self, engines: Sequence[Engine], *, names: Sequence[str] | None = None) -> None:
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        self.engines = list(engines)
        self.names = list(
            names or [getattr(e, "url", f"engine {i}") for i, e in enumerate(engines)]
        )
        self.alive = [True] * len(self.engines)
        self.outstanding = [0] * len(self.engines)
        self.failures: list[str] = []
        self._affinity: OrderedDict[str, int] = OrderedDict()

    def _live(self) -> list[Engine]:
        live = [e for e, ok in zip(self.engines, self.alive, strict=True) if ok]
        if not live:
            raise NoLiveEngineError("no live rollout engine is left: " + "; ".join(self.failures))
        return live

    @property
    def version(self) -> int:
        return min(e.version for e in self._live())

    @property
    def weight_sources(self) -> tuple[type, ...]:
        """The first engine's kinds that every live engine accepts."""
        live = self._live()
        return tuple(k for k in live[0].weight_sources if all(k in e.weight_sources for e in live))

    @property
    def takes_adapters(self) -> bool:
        """Every engine merges LoRA factors itself (``sao serve``): updates may send them."""
        return all(getattr(e, "takes_adapters", False) for e in self.engines)

    @property
    def lora_adapters(self) -> bool:
        """Every engine loads a LoRA policy's updates as peft adapters (vLLM's LoRA
        routes, ``rollout.lora_sync=adapter``)."""
        return all(getattr(e, "lora_adapters", False) for e in self.engines)

    @property
    def max_seq_len(self) -> int | None:
        lens = [getattr(e, "max_seq_len", None) for e in self.engines]
        known = [n for n in lens if isinstance(n, int)]
        return min(known) if known else None

    @property
    def kind(self) -> str:
        """What the engines are (``vllm``, ``sao serve``, ``sglang``, ...)."""
        return str(getattr(self.engines[0], "kind", type(self.engines[0]).__name__))

    @property
    def num_alive(self) -> int:
        return sum(self.alive)

    def _pick(self) -> int:
        key = episode_key.get()
        if key is not None and key in self._affinity and self.alive[self._affinity[key]]:
            self._affinity.move_to_end(key)
            return self._affinity[key]
        live = [i for i, ok in enumerate(self.alive) if ok]
        if not live:
            raise NoLiveEngineError(
                "no live rollout engine is left: " + "; ".join(self.failures[-len(self.engines) :])
            )
        i = min(live, key=lambda j: self.outstanding[j])
        if key is not None:
            self._affinity[key] = i
            if len(self._affinity) > MAX_AFFINITIES:
                self._affinity.popitem(last=False)
        return i

    def _mark_dead(self, i: int, err: BaseException) -> None:
        if self.alive[i]:
            self.alive[i] = False
            self.failures.append(f"{self.names[i]}: {err}")
            logger.warning(
                "rollout engine %s failed (%s); %d engine(s) left",
                self.names[i],
                err,
                self.num_alive,
            )

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        while True:
            i = self._pick()
            self.outstanding[i] += 1
            try:
                return await self.engines[i].generate(prompt_ids, sampling)
            except EngineError as err:
                self._mark_dead(i, err)
            finally:
                self.outstanding[i] -= 1

    async def join_weight_group(
        self, group: WeightGroup, first_rank: int = 1, *, host: bool = True
    ) -> None:
        """Every engine joins ``group`` as ranks ``first_rank``.. in order; ``host``:
        this process opens it as the trainer's rank 0 meanwhile (False: another
        process does, e.g. a Ray trainer rank)."""
        joins = [
            cast(Any, e).join_weight_group(group, first_rank + i)
            for i, e in enumerate(self.engines)
        ]
        opens = [asyncio.to_thread(group.open)] if host else []
        await asyncio.gather(*opens, *joins)

    async def update_weights(self, source: WeightSource) -> None:
        live = [i for i, ok in enumerate(self.alive) if ok]
        if isinstance(source, BroadcastWeights):  # one broadcast reaches every engine
            if not all(self.alive):
                raise NoLiveEngineError(
                    "a server of the weight-transfer group failed, and a broadcast needs every "
                    "rank: continue with `sao train --resume RUN_DIR`, or use "
                    "rollout.weight_transfer=disk to survive failures ("
                    + "; ".join(self.failures)
                    + ")"
                )
            group = cast(WeightGroup, source.group)
            updates = [cast(Any, self.engines[i]).receive_broadcast(source) for i in live]
            sends = [asyncio.to_thread(group.send, source.state_dict)] if source.send else []
            done = await asyncio.gather(*sends, *updates, return_exceptions=True)
            results = done[len(sends) :]
            for sent in done[: len(sends)]:
                if isinstance(sent, BaseException):
                    raise sent
        else:
            results = await asyncio.gather(
                *(self.engines[i].update_weights(source) for i in live), return_exceptions=True
            )
        for i, result in zip(live, results, strict=True):
            if isinstance(result, EngineError):
                self._mark_dead(i, result)
            elif isinstance(result, BaseException):
                raise result
        if not any(self.alive):
            raise NoLiveEngineError("no live rollout engine is left: " + "; ".join(self.failures))

    async def aclose(self) -> None:
        await asyncio.gather(*(e.aclose() for e in self.engines), return_exceptions=True)
