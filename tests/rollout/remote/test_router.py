"""The engine router: episode affinity, balance, versions on every engine,
and a run that survives an engine dying or hanging."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from sao.rollout.embedded.engine import TorchEngine
from sao.rollout.engine import episode_key
from sao.rollout.remote.http_engine import EngineSetupError, ModelIdentity
from sao.rollout.remote.router import EngineRouter, NoLiveEngineError
from sao.rollout.remote.server import EngineServer
from sao.rollout.remote.vllm_engine import VLLMEngine
from sao.rollout.weights import write_weights
from sao.types import SamplingParams
from tests.rollout.embedded.test_engine import build
from tests.rollout.engines import serving

PROMPT = [2, 7, 1, 8]


class Farm:
    """``n`` sao-serve servers over tiny engines; ``kill(i)`` stops server i."""

    def __init__(self) -> None:
        self.stacks: list[contextlib.AsyncExitStack] = []
        self.servers: list[EngineServer] = []
        self.urls: list[str] = []

    async def start(self, n: int) -> None:
        for _ in range(n):
            stack = contextlib.AsyncExitStack()
            engine = TorchEngine(build("llama", seed=0), max_seq_len=128, max_batch_size=4)
            stack.push_async_callback(engine.aclose)
            server = EngineServer(engine, model_name="tiny")
            self.urls.append(await stack.enter_async_context(serving(server.app)))
            self.servers.append(server)
            self.stacks.append(stack)

    async def kill(self, i: int) -> None:
        await self.stacks[i].aclose()

    async def close(self) -> None:
        for stack in self.stacks:
            await stack.aclose()


@contextlib.asynccontextmanager
async def farm_router(n: int, timeout_s: float = 30) -> AsyncIterator[tuple[Farm, EngineRouter]]:
    farm = Farm()
    await farm.start(n)
    clients = [VLLMEngine(u, request_timeout_s=timeout_s) for u in farm.urls]
    for c in clients:
        await c.connect(None, timeout_s=5)
    router = EngineRouter(clients, names=farm.urls)
    try:
        yield farm, router
    finally:
        await router.aclose()
        await farm.close()


def _record(router: EngineRouter) -> list[tuple[str | None, int]]:
    """Log (episode, engine index) of every generation the engines serve."""
    log: list[tuple[str | None, int]] = []
    for i, engine in enumerate(router.engines):
        inner = engine.generate

        async def generate(prompt, sampling, _i=i, _inner=inner):  # type: ignore[no-untyped-def]
            log.append((episode_key.get(), _i))
            return await _inner(prompt, sampling)

        engine.generate = generate  # type: ignore[method-assign]
    return log


async def _episode(router: EngineRouter, key: str, turns: int) -> None:
    episode_key.set(key)
    for _ in range(turns):
        await router.generate(PROMPT, SamplingParams(max_new_tokens=4))


def test_affinity_and_balance() -> None:
    async def go() -> list[tuple[str | None, int]]:
        async with farm_router(2) as (_, router):
            log = _record(router)
            await asyncio.gather(*(_episode(router, f"ep{k}", 3) for k in range(4)))
            return log

    log = asyncio.run(go())
    by_episode: dict[str | None, set[int]] = {}
    for key, i in log:
        by_episode.setdefault(key, set()).add(i)
    assert len(log) == 12 and len(by_episode) == 4
    assert all(len(engines) == 1 for engines in by_episode.values())  # one episode, one engine
    assert set().union(*by_episode.values()) == {0, 1}  # new episodes are spread


def test_every_version_reaches_every_engine(tmp_path: Path) -> None:
    async def go() -> list[int]:
        async with farm_router(2) as (farm, router):
            await router.update_weights(write_weights(build("llama", 1).state_dict(), tmp_path, 5))
            return [s.engine.version for s in farm.servers] + [router.version]

    assert asyncio.run(go()) == [5, 5, 5]


def test_a_dying_engine_moves_its_generations_and_the_last_one_stops_the_run() -> None:
    async def go() -> None:
        async with farm_router(2) as (farm, router):
            await farm.kill(0)
            outs = await asyncio.gather(
                *(router.generate(PROMPT, SamplingParams(max_new_tokens=3)) for _ in range(6))
            )
            assert all(len(c.token_ids) == 3 for c in outs)
            assert router.alive == [False, True] and farm.urls[0] in router.failures[0]
            await farm.kill(1)
            with pytest.raises(NoLiveEngineError, match="no live rollout engine"):
                await router.generate(PROMPT, SamplingParams(max_new_tokens=3))

    asyncio.run(go())


def test_a_hung_engine_times_out_and_is_replaced() -> None:
    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def go() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", hang)
        async with farm_router(1) as (_, good), serving(app) as url:
            stuck = VLLMEngine(url, request_timeout_s=0.5)
            stuck.model_name = "tiny"
            router = EngineRouter([stuck, good.engines[0]], names=[url, "good"])
            c = await router.generate(PROMPT, SamplingParams(max_new_tokens=2))
            assert len(c.token_ids) == 2 and router.alive == [False, True]
            assert "TimeoutError" in router.failures[0]

    asyncio.run(go())


def test_a_server_of_another_model_is_refused() -> None:
    async def go() -> None:
        async with farm_router(1) as (farm, _):
            client = VLLMEngine(farm.urls[0])
            other = ModelIdentity("/models/other", 151936, "qwen3", 28, 1024)
            try:
                with pytest.raises(EngineSetupError, match=r"serves another model.*vocab_size"):
                    await client.connect(other, timeout_s=5)
            finally:
                await client.aclose()

    asyncio.run(go())


def test_a_server_without_rl_routes_names_the_flag() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "max_model_len": 64}]})

    async def go() -> None:
        app = web.Application()
        app.router.add_get("/health", ok)
        app.router.add_get("/v1/models", ok)
        async with serving(app) as url:
            client = VLLMEngine(url)
            try:
                with pytest.raises(EngineSetupError, match="VLLM_SERVER_DEV_MODE=1"):
                    await client.connect(None, timeout_s=5)
            finally:
                await client.aclose()

    asyncio.run(go())


def test_an_unreachable_server_is_a_setup_error() -> None:
    async def go() -> None:
        client = VLLMEngine("http://127.0.0.1:9")
        try:
            with pytest.raises(EngineSetupError, match="did not become healthy"):
                await client.connect(None, timeout_s=1)
        finally:
            await client.aclose()

    asyncio.run(go())


def test_with_every_engine_dead_each_call_names_the_failures() -> None:
    async def go() -> None:
        async with farm_router(1) as (farm, router):
            await farm.kill(0)
            with pytest.raises(NoLiveEngineError):
                await router.generate(PROMPT, SamplingParams(max_new_tokens=2))
            for read in (lambda: router.version, lambda: router.weight_sources):
                with pytest.raises(NoLiveEngineError, match=farm.urls[0]):
                    read()

    asyncio.run(go())
