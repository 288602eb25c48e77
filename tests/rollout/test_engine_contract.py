"""One contract suite for every engine, local or over HTTP (STYLE.md 14):
exact log-probabilities, per-token versions across an in-flight weight
update, cancellation, and failure of a server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from sao.rollout.remote.http_engine import EngineError
from sao.rollout.remote.vllm_engine import VLLMEngine
from sao.rollout.weights import DiskWeights, TensorWeights, write_weights
from sao.types import SamplingParams
from tests.rollout.embedded.test_engine import build, reference_logp
from tests.rollout.engines import KINDS, open_engine

PROMPT = [2, 7, 1, 8, 2, 8]


@pytest.mark.parametrize("kind", KINDS)
def test_exact_logprobs(kind: str) -> None:
    model = build("llama", seed=0)

    async def go() -> list:
        async with open_engine(kind, model) as engine:
            params = [
                SamplingParams(temperature=t, max_new_tokens=12, seed=s)
                for t, s in ((0.7, 1), (1.3, 2))
            ]
            return await asyncio.gather(*(engine.generate(PROMPT, p) for p in params))

    for c, T in zip(asyncio.run(go()), (0.7, 1.3), strict=True):
        assert len(c.token_ids) == 12 and c.finish_reason == "length"
        assert c.versions == (0,) * 12
        ref = reference_logp(model, PROMPT, c.token_ids, T)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


def _source(engine: object, model: torch.nn.Module, root: Path, version: int) -> object:
    if TensorWeights in engine.weight_sources:  # type: ignore[attr-defined]
        return TensorWeights(model.state_dict(), version)
    return write_weights(model.state_dict(), root, version)


@pytest.mark.parametrize("kind", KINDS)
def test_versions_across_an_in_flight_update(kind: str, tmp_path: Path) -> None:
    """A long generation spans an update: its tokens carry version 0 then 1,
    and every token's log-probability is exact under the version it carries
    (the vLLM and SGLang clients resubmit after the pause, so the new tokens are
    conditioned on a fresh prefill by the new weights; the embedded engine, also
    behind `sao serve`, keeps its cache, so only the version boundary is checked
    there)."""
    old, new = build("llama", seed=0), build("llama", seed=1)
    n, T = 120, 1.0

    async def go() -> tuple:
        async with open_engine(kind, old) as engine:
            task = asyncio.create_task(
                engine.generate(PROMPT, SamplingParams(temperature=T, max_new_tokens=n))
            )
            await asyncio.sleep(0.05)
            await engine.update_weights(_source(engine, new, tmp_path, 1))
            assert engine.version == 1
            after = await engine.generate(PROMPT, SamplingParams(temperature=T, max_new_tokens=5))
            return await task, after

    during, after = asyncio.run(go())
    assert len(during.token_ids) == n
    assert list(during.versions) == sorted(during.versions)
    assert set(during.versions) <= {0, 1} and during.versions[0] == 0
    assert after.versions == (1,) * 5
    ref_after = reference_logp(new, PROMPT, after.token_ids, T)
    assert torch.allclose(torch.tensor(after.logprobs), ref_after, atol=1e-4, rtol=0)
    j = during.versions.index(1) if 1 in during.versions else n
    got = torch.tensor(during.logprobs)
    ref_old = reference_logp(old, PROMPT, during.token_ids, T)
    assert torch.allclose(got[:j], ref_old[:j], atol=1e-4, rtol=0)
    if kind in ("vllm-protocol", "sglang-fake") and j < n:
        ref_new = reference_logp(new, PROMPT, during.token_ids, T)
        assert torch.allclose(got[j:], ref_new[j:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_cancelled_generation_frees_the_engine(kind: str) -> None:
    model = build("llama", seed=0)

    async def go() -> tuple:
        async with open_engine(kind, model, max_batch_size=1) as engine:
            long = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_new_tokens=200)))
            await asyncio.sleep(0.05)
            long.cancel()
            with pytest.raises(asyncio.CancelledError):
                await long
            # the single slot is free again: a new request completes
            return await asyncio.wait_for(
                engine.generate(PROMPT, SamplingParams(max_new_tokens=3, seed=0)), 20
            )

    assert len(asyncio.run(go()).token_ids) == 3


def test_unreachable_server_is_an_engine_error() -> None:
    async def go() -> None:
        engine = VLLMEngine("http://127.0.0.1:9", request_timeout_s=2)
        try:
            with pytest.raises(EngineError, match=r"127\.0\.0\.1:9"):
                await engine.generate(PROMPT, SamplingParams(max_new_tokens=2))
        finally:
            await engine.aclose()

    asyncio.run(go())


def test_disk_weights_round_trip_with_tied_embeddings(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from sao.rollout.weights import read_weights, weights_version
    from tests.rollout.embedded.test_engine import SMALL

    torch.manual_seed(0)
    tied = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True))
    src = write_weights(tied.state_dict(), tmp_path, 3, config=tied.config)
    assert isinstance(src, DiskWeights) and src.path.name == "v00000003"
    assert weights_version(src.path) == 3 and (src.path / "config.json").is_file()
    state = read_weights(src.path)
    assert "lm_head.weight" not in state  # an alias of the embedding, written once
    for k, v in state.items():
        assert torch.equal(v, tied.state_dict()[k])
    for v in range(4, 8):
        write_weights(tied.state_dict(), tmp_path, v, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000006", "v00000007"]


@pytest.mark.parametrize("server", ["sao-serve", "sglang-fake"])
def test_broadcast_weights_over_a_gloo_group(
    server: str, tmp_path: Path, chatml_tok: object
) -> None:
    """Two server processes join the trainer's weight-transfer group; one
    broadcast updates both, and their log-probabilities follow the new weights."""
    import subprocess
    import sys

    from sao.rollout.remote.collective import WeightGroup
    from sao.rollout.remote.launch import free_port
    from sao.rollout.remote.router import EngineRouter
    from sao.rollout.remote.sglang_engine import SGLangEngine
    from sao.rollout.weights import BroadcastWeights

    old, new = build("llama", seed=0), build("llama", seed=1)
    old.save_pretrained(tmp_path / "model")
    chatml_tok.save_pretrained(tmp_path / "model")  # type: ignore[attr-defined]
    ports = [free_port() for _ in range(2)]
    module = ["sao.cli", "serve"] if server == "sao-serve" else ["tests.rollout.engines"]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                *module,
                str(tmp_path / "model"),
                *(["--port", str(p)] if server == "sao-serve" else [str(p)]),
            ],
            stdout=(tmp_path / f"server-{p}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        for p in ports
    ]
    client_cls = VLLMEngine if server == "sao-serve" else SGLangEngine

    async def go() -> list:
        clients = [client_cls(f"http://127.0.0.1:{p}", request_timeout_s=60) for p in ports]
        router = EngineRouter(clients)
        try:
            for c in clients:
                await c.connect(None, timeout_s=60)
            group = WeightGroup("127.0.0.1", free_port(), 3, timeout_s=60)
            await router.join_weight_group(group)
            await router.update_weights(BroadcastWeights(new.state_dict(), 7, group))
            sp = SamplingParams(temperature=0.9, max_new_tokens=8, seed=3)
            return [await c.generate(PROMPT, sp) for c in clients]
        finally:
            await router.aclose()

    try:
        outs = asyncio.run(go())
    finally:
        for p in procs:
            p.kill()
    for c in outs:
        assert c.token_ids and set(c.versions) == {7}
        ref = reference_logp(new, PROMPT, c.token_ids, 0.9)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)
