"""Engines under test, local and over HTTP, for the engine contract suite.

``open_engine(kind, model)`` is an async context manager yielding an
:class:`~sao.rollout.engine.Engine`:

- ``torch``: the embedded :class:`TorchEngine`.
- ``sao-serve``: ``sao serve`` (:class:`EngineServer`) on a loopback port,
  reached by :class:`VLLMEngine`; the server reports per-token versions.
- ``vllm-protocol``: the same server answering exactly as vLLM does (no
  per-token versions, no ``sao`` model info), so the client's own version
  rule (abort and resubmit) is what makes versions right.
- ``sglang-fake``: a faithful fake of SGLang's native routes (``/generate``
  with ``input_ids``, ``/pause_generation``, ``/update_weights_from_disk``,
  ``/continue_generation``) over the same embedded engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from transformers import PreTrainedModel

from sao.rollout.embedded.engine import TorchEngine
from sao.rollout.remote.collective import init_weight_group, receive_tensors
from sao.rollout.remote.server import EngineServer, _sampling
from sao.rollout.remote.sglang_engine import SGLangEngine
from sao.rollout.remote.vllm_engine import VLLMEngine
from sao.rollout.weights import read_weights

KINDS = ("torch", "sao-serve", "vllm-protocol", "sglang-fake")


class FakeSGLang:
    """SGLang's native HTTP routes over a :class:`TorchEngine`."""

    def __init__(self, engine: TorchEngine, model_path: str) -> None:
        self.engine, self.model_path = engine, model_path
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.weight_version = "default"
        self.app = web.Application()
        r = self.app.router
        r.add_get("/health", self.health)
        r.add_get("/model_info", self.model_info)
        r.add_post("/generate", self.generate)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.resume)
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        self.group: Any = None

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def model_info(self, request: web.Request) -> web.Response:
        info = {"model_path": self.model_path, "weight_version": self.weight_version}
        return web.json_response(info | {"is_generation": True})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        p = body["sampling_params"]
        sampling = _sampling(
            {
                "temperature": p.get("temperature", 1.0),
                "top_p": p.get("top_p", 1.0),
                "top_k": p.get("top_k", -1),
                "max_tokens": p.get("max_new_tokens", 128),
                "stop_token_ids": p.get("stop_token_ids"),
                "stop": p.get("stop"),
                "seed": p.get("sampling_seed"),
            }
        )
        await self.unpaused.wait()
        c = await self.engine.generate(body["input_ids"], sampling)
        finish: dict[str, Any] = {
            "type": {"aborted": "abort"}.get(c.finish_reason, c.finish_reason)
        }
        meta = {
            "id": "x",
            "finish_reason": finish,
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(c.token_ids),
            "output_token_logprobs": [
                [lp, t, None] for lp, t in zip(c.logprobs, c.token_ids, strict=True)
            ],
            "weight_version": self.weight_version,
            # SGLang reports spans of versions; this fake reports none, as an
            # older release would, so the client's own rule is what is tested
        }
        return web.json_response({"text": "", "output_ids": list(c.token_ids), "meta_info": meta})

    async def pause(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.unpaused.clear()
        if body.get("mode", "abort") == "abort":
            self.engine.abort_all()
        return web.json_response({})

    async def resume(self, request: web.Request) -> web.Response:
        self.unpaused.set()
        return web.json_response({})

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        state = await asyncio.to_thread(read_weights, body["model_path"])
        await asyncio.to_thread(self.engine.load_weights, state, self.engine.version)
        self.weight_version = body.get("weight_version") or self.weight_version
        return web.json_response({"success": True, "message": "ok"})

    async def init_group(self, request: web.Request) -> web.Response:
        b = await request.json()
        args = (b["backend"], b["master_address"], int(b["master_port"]), int(b["world_size"]))
        rank = int(b["rank_offset"])  # tp rank 0
        self.group = await asyncio.to_thread(
            init_weight_group, *args, rank, str(b.get("group_name", "weight_update_group"))
        )
        return web.json_response({"success": True, "message": "ok"})

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        b = await request.json()
        state = await asyncio.to_thread(
            receive_tensors, b["names"], b["dtypes"], b["shapes"], self.group, "cpu"
        )
        await asyncio.to_thread(self.engine.load_weights, state, self.engine.version)
        self.weight_version = b.get("weight_version") or self.weight_version
        return web.json_response({"success": True, "message": "ok"})


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """Run ``app`` on a free loopback port; yields its base URL."""
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def open_engine(
    kind: str, model: PreTrainedModel, *, max_seq_len: int = 256, max_batch_size: int = 8
) -> AsyncIterator[Any]:
    """An engine of ``kind`` (see :data:`KINDS`) sampling from ``model``."""
    local = TorchEngine(model, max_seq_len=max_seq_len, max_batch_size=max_batch_size)
    try:
        if kind == "torch":
            yield local
            return
        if kind == "sglang-fake":
            fake = FakeSGLang(local, "/models/tiny")
            async with serving(fake.app) as url:
                client = SGLangEngine(url, request_timeout_s=60)
                await client.connect(None, timeout_s=10)
                yield client
                await client.aclose()
            return
        server = EngineServer(local, model_name="tiny", report_versions=kind == "sao-serve")
        async with serving(server.app) as url:
            vclient = VLLMEngine(url, request_timeout_s=60)
            await vclient.connect(None, timeout_s=10)
            yield vclient
            await vclient.aclose()
    finally:
        await local.aclose()


def main() -> None:
    """``python -m tests.rollout.engines MODEL_DIR PORT``: the fake SGLang server
    as its own process (a weight-transfer group needs one process per rank)."""
    import sys

    from sao.models.loading import load_policy

    model_dir, port = sys.argv[1], int(sys.argv[2])
    engine = TorchEngine(load_policy(model_dir), max_seq_len=256, max_batch_size=8)
    fake = FakeSGLang(engine, model_dir)
    web.run_app(fake.app, host="127.0.0.1", port=port, print=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
