"""The vLLM worker extension and its wiring, without vLLM: the tied-head
refresh on a toy module tree, the launch command, and the RPC the client
sends. (The real server is tested in ``tests/integration/test_vllm.py``.)"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web

import sao
from sao.rollout.remote.launch import VLLM_WORKER_EXTENSION, sao_import_root, server_command
from sao.rollout.remote.vllm_engine import VLLMEngine
from sao.rollout.remote.vllm_worker import SaoWorkerExtension, _refresh_tied_prepacked
from sao.rollout.weights import DiskWeights

KW = dict(max_seq_len=128, max_batch_size=4, dtype="float32", device="cpu")


class _Method:
    """Stands in for a quant method: records which layers it re-packed."""

    def __init__(self) -> None:
        self.calls: list[torch.nn.Module] = []

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.calls.append(layer)


def _layer(weight: torch.nn.Parameter, method: _Method, *, packed: bool) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = weight
    layer.quant_method = method  # type: ignore[assignment]
    if packed:  # what vLLM's CPU GEMM dispatch leaves behind
        layer.cpu_linear = torch.nn.functional.linear  # type: ignore[assignment]
    return layer


def test_only_prepacked_tied_layers_are_refreshed() -> None:
    method = _Method()
    tied = torch.nn.Parameter(torch.randn(5, 3), requires_grad=False)
    model = torch.nn.Module()
    model.embed = _layer(tied, method, packed=True)
    model.proj = _layer(torch.nn.Parameter(torch.randn(3, 3)), method, packed=True)  # untied
    model.gone = _layer(torch.nn.Parameter(torch.empty(0)), method, packed=True)  # weight removed
    model.head = _layer(tied, method, packed=True)
    model.gpu_head = _layer(tied, method, packed=False)  # tied, but nothing pre-packed

    assert _refresh_tied_prepacked(model) == ["embed", "head"]
    assert method.calls == [model.embed, model.head]


def test_the_extension_has_one_attribute_for_vllm_to_mix_in() -> None:
    # vLLM asserts no extension attribute collides with the worker's
    public = [a for a in dir(SaoWorkerExtension) if not a.startswith("__")]
    assert public == ["reload_weights_and_refresh"]


def test_vllm_command_loads_the_extension_and_can_import_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    cmd, env = server_command("vllm", "/m", 8000, python="py", **KW)  # type: ignore[arg-type]
    i = cmd.index("--worker-extension-cls")
    assert (
        cmd[i + 1] == VLLM_WORKER_EXTENSION == "sao.rollout.remote.vllm_worker.SaoWorkerExtension"
    )
    first, root = env["PYTHONPATH"].split(os.pathsep)
    assert first == "/elsewhere"
    assert (Path(root) / "sao" / "rollout" / "remote" / "vllm_worker.py").is_file()


def test_an_installed_sao_is_linked_not_its_site_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "lib" / "site-packages" / "sao"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.setattr(sao, "__file__", str(package / "__init__.py"))
    monkeypatch.setenv("SAO_HOME", str(tmp_path / "home"))
    root = Path(sao_import_root())
    assert root == tmp_path / "home" / "pythonpath"
    assert sorted(p.name for p in root.iterdir()) == ["sao"]
    assert (root / "sao").resolve() == package.resolve()
    assert Path(sao_import_root()) == root  # a second call keeps the link


@pytest.mark.parametrize(
    ("refresh", "method"), [(True, "reload_weights_and_refresh"), (False, "reload_weights")]
)
def test_the_client_reloads_through_the_extension_when_told(
    refresh: bool, method: str, tmp_path: Path
) -> None:
    bodies: list[dict[str, Any]] = []

    async def rpc(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        return web.json_response({"results": [["lm_head"]]})

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def go() -> None:
        app = web.Application()
        app.router.add_post("/collective_rpc", rpc)
        for route in ("/pause", "/update_weight_version", "/reset_prefix_cache", "/resume"):
            app.router.add_post(route, ok)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = VLLMEngine(f"http://127.0.0.1:{port}", refresh_tied_head=refresh)
        try:
            await client.update_weights(DiskWeights(tmp_path, 3))
        finally:
            await client.aclose()
            await runner.cleanup()
        assert client.version == 3

    asyncio.run(go())
    assert bodies == [{"method": method, "kwargs": {"weights_path": str(tmp_path)}}]
