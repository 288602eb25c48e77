"""vLLM's OpenAI-compatible server (and ``sao serve``, which speaks its subset)
behind the :class:`~sao.rollout.engine.Engine` protocol: ``/v1/completions``
with token ids, paused, reloaded and resumed through vLLM's RL routes. The
session, the per-token version rule and the abort-and-resubmit loop are the
shared HTTP client's (:mod:`sao.rollout.remote.http_engine`)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from sao.rollout.remote.collective import WeightGroup, describe
from sao.rollout.remote.http_engine import (
    EngineError,
    EngineSetupError,
    ModelIdentity,
    _HttpEngine,
    _local_identity,
    _Part,
    _refuse_mismatch,
)
from sao.rollout.weights import BroadcastWeights, DiskWeights, WeightSource
from sao.types import SamplingParams

__all__ = ["VLLMEngine"]


class VLLMEngine(_HttpEngine):
    """vLLM's OpenAI-compatible server, or ``sao serve`` (same routes).

    The server must run with the RL routes enabled (``VLLM_SERVER_DEV_MODE=1``)
    and, at a temperature other than 1, ``--logprobs-mode processed_logprobs``
    (vLLM's default log-probabilities are taken before temperature, which
    would make the DIS ratio wrong; the log-prob preflight catches it).

    ``refresh_tied_head``: reload through the sao worker extension's
    ``reload_weights_and_refresh`` (the server was started with
    ``--worker-extension-cls sao.rollout.remote.vllm_worker.SaoWorkerExtension``, as
    ``rollout.launch`` does) instead of plain ``reload_weights``, whose CPU path
    leaves a tied LM head multiplying by the old embedding.

    ``lora_adapters`` (``rollout.lora_sync=adapter``): a LoRA policy's update is
    a peft adapter directory (:class:`DiskWeights` with ``peft``), loaded as a
    new adapter named for its version (``/v1/load_lora_adapter``; the server
    runs with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) while
    requests go on; then the pause ends the in-flight requests and they are
    submitted again naming the new adapter, as for a reload, so every token's
    version is still the one its request named. The adapter before it stays
    loaded (a request in transit at the pause may name it); older ones are
    unloaded. No weight of the base model changes, so nothing is reloaded and
    no separate prefix-cache reset runs (the pause clears the cache anyway).
    """

    kind = "vllm"

    def __init__(
        self,
        url: str,
        *,
        version: int = 0,
        request_timeout_s: float = 600.0,
        max_seq_len: int | None = None,
        refresh_tied_head: bool = False,
    ) -> None:
        super().__init__(
            url, version=version, request_timeout_s=request_timeout_s, max_seq_len=max_seq_len
        )
        self.refresh_tied_head = refresh_tied_head
        self.takes_adapters = False
        """True for a ``sao serve`` that merges LoRA factors itself (a weight directory
        written with ``write_weights(..., adapter=...)``); vLLM takes merged weights."""
        self.lora_adapters = False
        """True to load a LoRA policy's updates through vLLM's LoRA routes (see above)."""
        self._adapters: list[str] = []  # loaded by this client, oldest first
        self._tag = uuid.uuid4().hex[:8]  # adapter names never collide with another run's

    async def connect(self, identity: ModelIdentity | None, timeout_s: float = 30.0) -> None:
        await self.wait_ready(timeout_s)
        data = await self._ok("GET", "/v1/models")
        models = (data or {}).get("data") or []
        if not models:
            raise EngineSetupError(f"{self.kind} server {self.url} lists no model on /v1/models")
        info = models[0]
        self.model_name = str(info.get("id", ""))
        if info.get("max_model_len") and not hasattr(self, "max_seq_len"):
            self.max_seq_len = int(info["max_model_len"])
        sao_info = info.get("sao")
        if isinstance(sao_info, dict):
            self.kind = "sao serve"
            self.keeps_versions = True  # it reports the version of every token
            self.takes_adapters = bool(sao_info.get("adapters", False))
            self._version = int(sao_info.get("version", self._version))
        if identity is not None:
            theirs = (
                ModelIdentity(
                    str(info.get("root", self.model_name)),
                    int(sao_info.get("vocab_size", 0) or 0),
                    str(sao_info.get("model_type", "")),
                    int(sao_info.get("num_hidden_layers", 0) or 0),
                    int(sao_info.get("hidden_size", 0) or 0),
                )
                if isinstance(sao_info, dict)
                else _local_identity(str(info.get("root", "")))
            )
            if theirs is not None:
                _refuse_mismatch(self.kind, self.url, identity, theirs)
        status, body = await self._call("GET", "/is_paused")
        if status == 404:
            raise EngineSetupError(
                f"{self.kind} server {self.url} has no RL routes (/pause, /collective_rpc "
                "answered 404): start vLLM with the environment variable VLLM_SERVER_DEV_MODE=1"
            )
        if isinstance(body, dict) and body.get("is_paused"):
            await self._resume()

    async def _complete(self, prompt: list[int], sampling: SamplingParams) -> _Part:
        body: dict[str, Any] = {
            "model": self.model_name,
            "prompt": prompt,
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.stop_strings:
            body["stop"] = list(sampling.stop_strings)
        data = await self._ok("POST", "/v1/completions", body)
        try:
            choice = data["choices"][0]
            lp = choice.get("logprobs") or {}
            ids = choice.get("token_ids")
            if ids is None:
                ids = [int(str(t).rsplit(":", 1)[-1]) for t in lp.get("tokens") or []]
            logps = [float(x) for x in lp.get("token_logprobs") or []]
            versions = choice.get("sao_versions")
            finish = str(choice.get("finish_reason") or "length")
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise EngineError(
                f"{self.kind} server {self.url}: unexpected completion {data!r:.300}"
            ) from err
        if len(logps) != len(ids):
            raise EngineError(
                f"{self.kind} server {self.url} returned {len(ids)} tokens but {len(logps)} "
                "log-probabilities (send logprobs=0 and return_token_ids=true)"
            )
        return _Part(
            [int(t) for t in ids], logps, None if versions is None else list(versions), finish
        )

    @property
    def supports_broadcast(self) -> bool:
        # vLLM's own NCCL transfer needs its trainer-side group (vLLM's
        # StatelessProcessGroup), which is not built; `sao serve` joins a torch group.
        return self.kind == "sao serve"

    @property
    def weight_sources(self) -> tuple[type, ...]:
        return (DiskWeights, BroadcastWeights) if self.supports_broadcast else (DiskWeights,)

    async def _join(self, group: WeightGroup, rank_offset: int) -> None:
        info = {
            "master_address": group.master_address,
            "master_port": group.master_port,
            "rank_offset": rank_offset,
            "world_size": group.world_size,
            "backend": group.backend,
            "group_name": group.group_name,
        }
        await self._ok("POST", "/init_weight_transfer_engine", {"init_info": info})

    async def _receive(self, source: BroadcastWeights) -> None:
        body: dict[str, Any] = {"update_info": describe(source.state_dict)}
        if source.adapter is not None:  # LoRA factors (sao serve merges them)
            body["adapter"] = dict(source.adapter)
        await self._ok("POST", "/update_weights", body | {"version": source.version})

    async def update_weights(self, source: WeightSource) -> None:
        if isinstance(source, DiskWeights) and source.peft:
            name = await self._load_adapter(source)  # running requests keep their adapter
            await self._paused(self._switch_adapter(name), source.version)
            return
        await super().update_weights(source)

    async def _load_adapter(self, source: DiskWeights) -> str:
        name = f"sao-{self._tag}-v{source.version}"
        body = {"lora_name": name, "lora_path": str(source.path)}
        status, data = await self._call("POST", "/v1/load_lora_adapter", body)
        if status >= 500:
            raise EngineError(
                f"{self.kind} server {self.url} failed to load adapter {name}: {data!r:.300}"
            )
        if status >= 400:
            raise EngineSetupError(
                f"{self.kind} server {self.url} cannot load the LoRA adapter {source.path} "
                f"({status}: {data!r:.300}). rollout.lora_sync=adapter needs vLLM started with "
                "--enable-lora --max-lora-rank R (R >= model.lora.rank) --max-loras 2 and the "
                "environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (rollout.launch "
                "starts it so), or set rollout.lora_sync=merged"
            )
        return name

    async def _switch_adapter(self, name: str) -> None:
        self.model_name = name
        self._adapters.append(name)
        while len(self._adapters) > 2:
            old = self._adapters.pop(0)
            status, data = await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": old})
            if status >= 500:
                raise EngineError(
                    f"{self.kind} server {self.url} failed to unload {old}: {data!r:.300}"
                )

    async def _pause(self) -> None:
        await self._ok("POST", "/pause", params={"mode": "abort", "clear_cache": "true"})

    async def _reload(self, source: DiskWeights) -> None:
        method = "reload_weights_and_refresh" if self.refresh_tied_head else "reload_weights"
        body = {"method": method, "kwargs": {"weights_path": str(source.path)}}
        await self._ok("POST", "/collective_rpc", body)
        await self._ok("POST", "/update_weight_version", {"new_version": str(source.version)})
        for _ in range(50):  # vLLM answers success=false while a request still runs
            done = await self._ok("POST", "/reset_prefix_cache")
            if not (isinstance(done, dict) and done.get("success") is False):
                return
            await asyncio.sleep(0.05)
        raise EngineError(f"{self.kind} server {self.url} did not reset its prefix cache")

    async def _resume(self) -> None:
        await self._ok("POST", "/resume")
