"""vLLM (the CPU build) serving a real pretrained checkpoint, SmolLM2-135M-Instruct.

Skipped unless both ``SAO_VLLM_PYTHON`` (a vLLM install, as for
tests/integration/test_vllm.py) and ``SAO_REAL_MODEL`` (the directory ``sao
models fetch smollm2-135m`` prints, as for test_real_checkpoint.py) are set;
``make test-vllm`` sets both. One server, launched the way ``rollout.launch =
1`` launches it; most of the time is vLLM's decoding, on one core (it keeps
the other for itself): 260-874 s measured with other jobs on the two cores.

Checks, all float32 on both sides:

(a) tokens and log-probabilities vLLM returns for sampled replies (temperature
    1 and 0.7, fixed seeds) against the trainer's recomputed log-probabilities
    of the same tokens (:func:`sao.models.logprobs.sequence_logprobs`, what
    ``sao check`` compares), and greedy replies (``top_k = 1``) against the
    embedded engine's greedy tokens;
(b) weight updates through the trainer's publish path
    (:func:`sao.app.engines.make_publish`: a safetensors directory, then the
    sao worker extension's reload): afterwards vLLM's log-probabilities are
    the new weights'. The checkpoint ties its head to the embedding and ships
    only ``model.embed_tokens.weight``; an update that changes only the
    embedding must move the head with it: vLLM's log-probs match a model
    whose head is the new embedding and not one whose head kept the old
    embedding (the stale pre-packed head vllm_worker.py re-packs);
(c) a LoRA policy's update (adapters on q and v): only the fused q/k/v weights
    ship, and vLLM's log-probabilities are the adapted model's.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sao.app.engines import make_publish
from sao.models.loading import load_policy, load_tokenizer
from sao.models.logprobs import sequence_logprobs
from sao.models.lora import add_lora
from sao.rollout.embedded.engine import TorchEngine
from sao.rollout.remote.http_engine import ModelIdentity
from sao.rollout.remote.vllm_engine import VLLMEngine
from sao.rollout.weights import read_weights
from sao.types import Completion, SamplingParams
from tests.integration.test_vllm import start_server

VLLM_PYTHON = os.environ.get("SAO_VLLM_PYTHON", "")
REAL_MODEL = os.environ.get("SAO_REAL_MODEL", "")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.real,
    pytest.mark.skipif(
        not (VLLM_PYTHON and REAL_MODEL),
        reason="set SAO_VLLM_PYTHON and SAO_REAL_MODEL (make test-vllm)",
    ),
]
# Float32 on both sides: measured 3.4e-5 to 4.8e-5 per ~150-token check, the same
# model summed in another order (vLLM's oneDNN GEMMs and CPU attention against
# torch's) through 30 layers and a log-softmax over 49,152 logits; the tiny
# models of test_vllm.py show ~1e-6. A wrong head or a stale version is > 1e-2.
TOL = 1e-4
QUESTIONS = ["What is 7 + 5?", "Name a colour.", "Explain rain in one sentence.", "What is 9 * 4?"]


def report_line(capsys: pytest.CaptureFixture[str], text: str) -> None:
    """Show a measured number in the test output even when it passes."""
    with capsys.disabled():
        print(f"\n  {text}")


def chat_prompts(tok: PreTrainedTokenizerBase) -> list[list[int]]:
    """Each of QUESTIONS as a user turn through the chat template, as token ids."""
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]
    return [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


def trainer_logprobs(
    model: PreTrainedModel, prompt: Sequence[int], tokens: Sequence[int], temperature: float
) -> torch.Tensor:
    """``logp_T`` of ``tokens`` after ``prompt``: the trainer's forward
    (:func:`sequence_logprobs`, float32) over the whole sequence."""
    ids_1S = torch.tensor([[*prompt, *tokens]])
    with torch.no_grad():
        logp_1S = sequence_logprobs(model, ids_1S, torch.ones_like(ids_1S), temperature=temperature)
    return logp_1S[0, len(prompt) :]


def embedded_replies(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
) -> list[list[int]]:
    """The embedded engine's reply tokens to each of ``prompts`` (the reference for
    vLLM's greedy replies)."""

    async def go() -> list[list[int]]:
        engine = TorchEngine(model, max_batch_size=4, max_seq_len=512, tokenizer=tok)
        try:
            outs = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
        finally:
            await engine.aclose()
        return [list(c.token_ids) for c in outs]

    return asyncio.run(go())


def max_gap(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    outs: Sequence[Completion],
    temperature: float,
) -> float:
    """max |vLLM logp - trainer logp| over every token of ``outs``."""
    gaps = [
        (torch.tensor(c.logprobs) - trainer_logprobs(model, p, c.token_ids, temperature)).abs()
        for p, c in zip(prompts, outs, strict=True)
    ]
    return float(torch.cat(gaps).max())


def embedding_perturbed(model: PreTrainedModel, scale: float, seed: int) -> None:
    """``embed_tokens += scale * std * N(0, 1)`` in place; the tied head moves with it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.add_(scale * emb.std() * torch.randn(emb.shape, generator=gen))


def with_stale_head(model: PreTrainedModel, old_embedding: torch.Tensor) -> PreTrainedModel:
    """``model`` untied: its input embedding as is, its head the old embedding
    (what a reload that missed the tied head would serve)."""
    stale = load_policy(REAL_MODEL)
    stale.load_state_dict(model.state_dict())
    stale.config.tie_word_embeddings = False
    stale.lm_head.weight = torch.nn.Parameter(old_embedding.clone())
    assert stale.lm_head.weight is not stale.get_input_embeddings().weight
    return stale


@pytest.mark.timeout(1200)
def test_vllm_serves_the_real_checkpoint_and_its_weight_updates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tok, policy = load_tokenizer(REAL_MODEL), load_policy(REAL_MODEL).eval()
    prompts = chat_prompts(tok)
    stop = (int(tok.eos_token_id),)
    sampled = [
        SamplingParams(temperature=t, max_new_tokens=40, seed=s, stop_token_ids=stop)
        for t, s in ((1.0, 1), (0.7, 2))
    ]
    greedy = SamplingParams(top_k=1, max_new_tokens=32, stop_token_ids=stop)
    reference_greedy = embedded_replies(policy, tok, prompts, greedy)
    gaps: dict[str, float] = {}

    async def go() -> None:
        async with start_server(Path(REAL_MODEL), tmp_path) as (server,):
            client = VLLMEngine(server.url, request_timeout_s=300, refresh_tied_head=True)
            try:
                await client.connect(ModelIdentity.from_config(REAL_MODEL, policy.config))
                await check_version(client, 0, policy, "v0", sampled)
                outs = await asyncio.gather(*(client.generate(p, greedy) for p in prompts))
                assert [list(c.token_ids) for c in outs] == reference_greedy
                assert "7 + 5 = 12" in tok.decode(outs[0].token_ids)

                # (b) the embedding alone changes: the tied head must follow it
                old_embedding = policy.get_input_embeddings().weight.detach().clone()
                embedding_perturbed(policy, 0.1, seed=1)
                publish = make_publish(client, policy, tmp_path / "weights")
                await publish(1)
                written = read_weights(tmp_path / "weights" / "v00000001")
                assert "lm_head.weight" not in written  # tied: only embed_tokens ships
                assert client.version == 1
                outs = await check_version(client, 1, policy, "v1 (embedding only)", sampled[:1])
                stale = with_stale_head(policy, old_embedding)
                gaps["stale head"] = max_gap(stale, prompts, outs, 1.0)
                assert gaps["stale head"] > 1e-2  # vLLM's head is the new embedding

                # every weight changes (what an optimizer step does)
                gen = torch.Generator().manual_seed(2)
                with torch.no_grad():
                    for p in policy.parameters():
                        p.add_(0.02 * p.std() * torch.randn(p.shape, generator=gen))
                await publish(2)
                await check_version(client, 2, policy, "v2 (every weight)", sampled[1:])

                # (c) LoRA on q and v, moved as training moves it: the update ships the
                # merged q and v and the unchanged k (vLLM reloads the fused qkv whole)
                add_lora(policy, rank=8, alpha=16.0, targets=["q_proj", "v_proj"])
                gen = torch.Generator().manual_seed(3)
                with torch.no_grad():
                    for name, p in policy.named_parameters():
                        if ".lora_" in name:
                            p.add_(0.05 * torch.randn(p.shape, generator=gen))
                await publish(3)
                written = read_weights(tmp_path / "weights" / "v00000003")
                assert {k.rsplit(".", 2)[-2] for k in written} == {"q_proj", "k_proj", "v_proj"}
                await check_version(client, 3, policy, "v3 (LoRA on q, v)", sampled[:1])
            finally:
                await client.aclose()

    async def check_version(
        client: VLLMEngine,
        version: int,
        model: PreTrainedModel,
        label: str,
        samplings: Sequence[SamplingParams],
    ) -> list[Completion]:
        """Sample every prompt under each of ``samplings``: all tokens carry
        ``version`` and ``model``'s log-probs; returns the first's replies."""
        replies = []
        for s in samplings:
            outs = await asyncio.gather(*(client.generate(p, s) for p in prompts))
            assert all(c.versions == (version,) * len(c.token_ids) for c in outs)
            tokens = sum(len(c.token_ids) for c in outs)
            gap = max_gap(model, prompts, outs, s.temperature)
            gaps[f"{label} T={s.temperature}"] = gap
            report_line(
                capsys,
                f"vLLM vs trainer, {label}, T={s.temperature}: max |dlogp| {gap:.2e} "
                f"over {tokens} tokens",
            )
            assert tokens >= 40 and gap < TOL, gaps
            replies.append(outs)
        return replies[0]

    asyncio.run(go())
    report_line(capsys, f"stale-head model vs vLLM after v1: {gaps['stale head']:.3f}")


def test_vllm_samples_lora_policies_through_its_adapter_routes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rollout.lora_sync=adapter`` on the real checkpoint: rank-8 adapters on every
    linear layer (the config's default, so vLLM's packed q/k/v and gate/up take
    them too), published through the trainer's path as peft adapters; vLLM's
    log-probabilities are the adapted policy's at the first version (B = 0, the
    base model) and after a move that changes them by more than 1e-2."""
    tok, policy = load_tokenizer(REAL_MODEL), load_policy(REAL_MODEL).eval()
    add_lora(policy, rank=8, alpha=16.0, targets="all-linear")
    prompts = chat_prompts(tok)
    stop = (int(tok.eos_token_id),)
    sampling = SamplingParams(temperature=0.7, max_new_tokens=40, seed=5, stop_token_ids=stop)

    async def go() -> dict[str, float]:
        gaps: dict[str, float] = {}
        async with start_server(Path(REAL_MODEL), tmp_path, lora_rank=8) as (server,):
            client = VLLMEngine(server.url, request_timeout_s=300, refresh_tied_head=True)
            client.lora_adapters = True
            try:
                await client.connect(ModelIdentity.from_config(REAL_MODEL, policy.config))
                publish = make_publish(client, policy, tmp_path / "weights")
                for version in (0, 1):
                    if version:
                        gen = torch.Generator().manual_seed(7)
                        with torch.no_grad():
                            for name, p in policy.named_parameters():
                                if ".lora_B" in name:
                                    p.add_(0.01 * torch.randn(p.shape, generator=gen))
                    await publish(version)
                    assert client.model_name == f"sao-{client._tag}-v{version}"
                    outs = await asyncio.gather(*(client.generate(p, sampling) for p in prompts))
                    assert all(c.versions == (version,) * len(c.token_ids) for c in outs)
                    assert sum(len(c.token_ids) for c in outs) >= 40
                    gaps[f"v{version}"] = max_gap(policy, prompts, outs, 0.7)
                    if version:
                        base = load_policy(REAL_MODEL).eval()
                        gaps["v1 against the base"] = max_gap(base, prompts, outs, 0.7)
            finally:
                await client.aclose()
        return gaps

    gaps = asyncio.run(go())
    report_line(capsys, f"vLLM LoRA adapters vs trainer: {gaps}")
    assert gaps["v0"] < TOL and gaps["v1"] < TOL and gaps["v1 against the base"] > 1e-2, gaps
