"""The HTTP client does not reuse a connection the server closed for idling.

vLLM's server (uvicorn) closes a keep-alive connection idle for 5 s; aiohttp's
pool kept it 15 s, so a POST sent after the trainer held the event loop for
a few seconds (a real model's forward) was written into a closed connection
and failed. Scaled down here: the server closes after 0.3 s, the client's pool
keeps connections 0.1 s (3 s against vLLM's 5)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
from aiohttp import web

from sao.rollout.remote import http_engine
from sao.rollout.remote.vllm_engine import VLLMEngine


@pytest.fixture
def server_closing_idle_connections() -> Iterator[str]:
    """A server in its own thread that closes a connection idle for 0.3 s
    (vLLM's uvicorn: 5 s); yields its URL."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    url: list[str] = []

    async def echo(request: web.Request) -> web.Response:
        return web.json_response(await request.json())

    async def start() -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/echo", echo)
        runner = web.AppRunner(app, keepalive_timeout=0.3)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")  # type: ignore[union-attr]
        return runner

    def serve() -> None:
        asyncio.set_event_loop(loop)
        runner = loop.run_until_complete(start())
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait(10)
    yield url[0]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_the_pool_forgets_connections_before_vllm_closes_them() -> None:
    assert http_engine.KEEPALIVE_S < 5  # VLLM_HTTP_TIMEOUT_KEEP_ALIVE's default


def test_a_post_after_the_loop_was_busy_past_the_servers_keepalive(
    server_closing_idle_connections: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_engine, "KEEPALIVE_S", 0.1)  # with aiohttp's 15 s this fails
    client = VLLMEngine(server_closing_idle_connections, request_timeout_s=10)

    async def go() -> list:
        try:
            first = await client._ok("POST", "/echo", {"n": 1})
            time.sleep(0.6)  # a forward pass holding the event loop; the server closes
            return [first, await client._ok("POST", "/echo", {"n": 2})]
        finally:
            await client.aclose()

    assert asyncio.run(go()) == [{"n": 1}, {"n": 2}]
