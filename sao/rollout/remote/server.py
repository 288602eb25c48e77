"""``sao serve``: the embedded engine behind the vLLM-compatible HTTP subset
that :class:`~sao.rollout.remote.vllm_engine.VLLMEngine` speaks, so rollouts can run
in other processes or on other machines without vLLM.

Routes (request and response fields as vLLM's OpenAI-compatible server):

- ``GET /health``, ``GET /v1/models`` (``id``, ``root``, ``max_model_len``,
  plus ``sao``: vocabulary size, model type, current weight version).
- ``POST /v1/completions``: ``prompt`` a list of token ids, ``max_tokens``,
  ``temperature``, ``top_p``, ``top_k`` (-1 or 0 disables), ``seed``,
  ``stop_token_ids``, ``stop``, ``logprobs``; the choice carries
  ``token_ids``, ``logprobs.token_logprobs``, ``logprobs.tokens``
  (``"token_id:N"``) and, beyond vLLM, ``sao_versions``: the weight version
  that sampled each token.
- ``POST /pause?mode=abort|keep|wait``, ``POST /resume``, ``GET /is_paused``:
  while paused new requests wait; ``abort`` finishes in-flight requests now
  with ``finish_reason="abort"`` (their tokens so far are returned), ``wait``
  waits for them to finish, ``keep`` lets them run (their tokens carry exact
  versions, so nothing needs freezing).
- ``POST /collective_rpc`` with ``{"method": "reload_weights", "kwargs":
  {"weights_path": DIR}}``: load a weight directory
  (:func:`~sao.rollout.weights.write_weights`), or the LoRA factors one holds
  (its ``sao_weights.json`` says ``"adapter"``; ``/v1/models`` lists ``"adapters":
  true``), merged into the loaded weights (``TorchEngine.load_adapter``);
  ``POST /update_weight_version``
  ``{"new_version": v}`` sets the version the next tokens carry;
  ``POST /reset_prefix_cache``.
- ``POST /init_weight_transfer_engine`` (join the trainer's weight-transfer
  group), ``POST /update_weights`` with ``update_info`` (names, dtype names,
  shapes) and ``version``: receive one broadcast version; with ``adapter``
  (scaling by module, ``fan_in_fan_out``) the tensors are LoRA factors, merged
  as a weight directory's are.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from sao.rollout.embedded.engine import TorchEngine
from sao.rollout.remote.collective import init_weight_group, receive_tensors
from sao.rollout.weights import read_weights, weights_adapter, weights_version
from sao.types import Completion, SamplingParams

__all__ = ["EngineServer", "serve"]

FINISH = {"stop": "stop", "length": "length", "aborted": "abort"}


class BadRequest(web.HTTPBadRequest):
    def __init__(self, message: str) -> None:
        super().__init__(text=message)


def _sampling(body: dict[str, Any]) -> SamplingParams:
    """vLLM completion fields -> :class:`SamplingParams` (a bad value is a 400)."""
    stop = body.get("stop") or ()
    try:
        return SamplingParams(
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)),
            top_k=max(int(body.get("top_k", 0) or 0), 0),
            max_new_tokens=int(body.get("max_tokens", 16)),
            stop_token_ids=tuple(int(t) for t in body.get("stop_token_ids") or ()),
            stop_strings=(stop,) if isinstance(stop, str) else tuple(stop),
            seed=None if body.get("seed") is None else int(body["seed"]),
        )
    except (TypeError, ValueError) as err:
        raise BadRequest(f"invalid sampling parameters: {err}") from None


class EngineServer:
    """The HTTP front of one :class:`TorchEngine`."""

    def __init__(
        self,
        engine: TorchEngine,
        *,
        model_name: str,
        model_info: dict[str, Any] | None = None,
        report_versions: bool = True,
    ) -> None:
        """``report_versions=False`` leaves out ``sao_versions`` and the ``sao``
        model info, so the server answers exactly as vLLM does (tests use it to
        check the client's version rule)."""
        self.engine, self.model_name = engine, model_name
        self.model_info = dict(model_info or {"vocab_size": engine.vocab_size})
        self.report_versions = report_versions
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._running: set[asyncio.Task[Completion]] = set()
        self.app = web.Application(client_max_size=64 * 1024**2)
        r = self.app.router
        r.add_get("/health", self.health)
        r.add_get("/v1/models", self.models)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/pause", self.pause)
        r.add_post("/resume", self.resume)
        r.add_get("/is_paused", self.is_paused)
        r.add_post("/collective_rpc", self.collective_rpc)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_post("/init_weight_transfer_engine", self.init_weight_transfer)
        r.add_post("/update_weights", self.update_weights)
        self._group: Any = None
        self._backend = "gloo"

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        info: dict[str, Any] = {
            "id": self.model_name,
            "object": "model",
            "root": self.model_name,
            "max_model_len": self.engine.max_seq_len,
        }
        if self.report_versions:
            info["sao"] = self.model_info | {"version": self.engine.version, "adapters": True}
        return web.json_response({"object": "list", "data": [info]})

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise BadRequest("`prompt` must be a list of token ids (sao serve takes no text)")
        if body.get("stream"):
            raise BadRequest("sao serve does not stream; send stream=false")
        sampling = _sampling(body)
        await self._unpaused.wait()
        task = asyncio.ensure_future(self.engine.generate(prompt, sampling))
        self._running.add(task)
        try:
            c = await task
        except ValueError as err:
            raise BadRequest(str(err)) from None
        finally:
            self._running.discard(task)
        choice: dict[str, Any] = {
            "index": 0,
            "text": "",
            "token_ids": list(c.token_ids),
            "logprobs": {
                "tokens": [f"token_id:{t}" for t in c.token_ids],
                "token_logprobs": list(c.logprobs),
                "top_logprobs": None,
                "text_offset": [],
            },
            "finish_reason": FINISH[c.finish_reason],
        }
        if self.report_versions:
            choice["sao_versions"] = list(c.versions)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(c.token_ids)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return web.json_response(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [choice],
                "usage": usage,
            }
        )

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "keep", "wait"):
            raise BadRequest(f"pause mode must be abort, keep or wait, got {mode!r}")
        self._unpaused.clear()
        if mode == "abort":
            self.engine.abort_all()
        if mode in ("abort", "wait") and self._running:
            await asyncio.wait(set(self._running))
        return web.json_response({"status": "paused", "mode": mode})

    async def resume(self, request: web.Request) -> web.Response:
        self._unpaused.set()
        return web.json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": not self._unpaused.is_set()})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        method, kwargs = body.get("method"), body.get("kwargs") or {}
        if method != "reload_weights":
            raise BadRequest(
                f"sao serve supports collective_rpc method 'reload_weights', not {method!r}"
            )
        path = kwargs.get("weights_path")
        if not path or not Path(path).is_dir():
            raise BadRequest(f"reload_weights: weights_path {path!r} is not a directory")
        try:
            state = await asyncio.to_thread(read_weights, path)
            version = weights_version(path)
            version = self.engine.version if version is None else version
            adapter = weights_adapter(path)
            if adapter is not None:  # LoRA factors: the engine merges them into its weights
                await asyncio.to_thread(self.engine.load_adapter, state, adapter, version)
            else:
                await asyncio.to_thread(self.engine.load_weights, state, version)
        except (KeyError, ValueError, FileNotFoundError) as err:
            raise BadRequest(f"reload_weights: {err}") from None
        return web.json_response({"results": [None]})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        version = body.get("new_version", body.get("version"))
        if version is None:
            raise BadRequest("update_weight_version needs {'new_version': N}")
        await asyncio.to_thread(self.engine.load_weights, {}, int(version))
        return web.json_response({"version": int(version)})

    async def init_weight_transfer(self, request: web.Request) -> web.Response:
        """Join the trainer's weight-transfer group (:mod:`sao.rollout.remote.collective`)."""
        info = (await request.json()).get("init_info") or {}
        try:
            self._group = await asyncio.to_thread(
                init_weight_group,
                str(info.get("backend", "gloo")),
                str(info["master_address"]),
                int(info["master_port"]),
                int(info["world_size"]),
                int(info["rank_offset"]),
                str(info["group_name"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise BadRequest(f"init_weight_transfer_engine: bad init_info ({err})") from None
        self._backend = str(info.get("backend", "gloo"))
        return web.json_response({"success": True})

    async def update_weights(self, request: web.Request) -> web.Response:
        """Receive one broadcast version and apply it between two decode steps."""
        if self._group is None:
            raise BadRequest("update_weights before init_weight_transfer_engine")
        body = await request.json()
        info = body.get("update_info") or {}
        state = await asyncio.to_thread(
            receive_tensors,
            info.get("names", []),
            info.get("dtype_names", []),
            info.get("shapes", []),
            self._group,
            "cpu" if self._backend == "gloo" else self.engine.device,
        )
        version = int(body.get("version", self.engine.version))
        adapter = body.get("adapter")
        try:
            if isinstance(adapter, dict):  # LoRA factors: the engine merges them
                await asyncio.to_thread(self.engine.load_adapter, state, adapter, version)
            else:
                await asyncio.to_thread(self.engine.load_weights, state, version)
        except (KeyError, ValueError) as err:
            raise BadRequest(f"update_weights: {err}") from None
        return web.json_response({"success": True, "version": version})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        reset = getattr(self.engine, "reset_prefix_cache", None)
        if callable(reset):
            await asyncio.to_thread(reset)
        return web.json_response({"success": True})


def serve(
    model_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch_size: int = 64,
    max_seq_len: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
) -> None:
    """Load ``model_dir`` into a :class:`TorchEngine` and serve it until killed."""
    import torch

    from sao.models.loading import load_policy, load_tokenizer

    model = load_policy(model_dir, dtype=getattr(torch, dtype))
    tokenizer = load_tokenizer(model_dir)
    engine = TorchEngine(
        model,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        device=device,
        tokenizer=tokenizer,
    )
    config = model.config
    model_info = {
        "vocab_size": engine.vocab_size,
        "model_type": config.model_type,
        "num_hidden_layers": getattr(config, "num_hidden_layers", 0),
        "hidden_size": getattr(config, "hidden_size", 0),
    }
    server = EngineServer(engine, model_name=str(model_dir), model_info=model_info)
    del model  # the engine holds its own copy
    print(f"sao serve: {model_dir} on http://{host}:{port}", flush=True)
    # handler_cancellation: a client that disconnects cancels its generation
    web.run_app(
        server.app,
        host=host,
        port=port,
        print=None,
        handle_signals=True,
        handler_cancellation=True,
    )
    engine.close()
