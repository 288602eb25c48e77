"""The embedded torch engine against naive full forward passes of tiny seeded
models: exact log-probabilities, continuous batching, stops, weight updates."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from sao.rollout.embedded.engine import TorchEngine
from sao.rollout.engine import Engine
from sao.types import Completion, SamplingParams

V = 64
SMALL: dict[str, Any] = dict(
    vocab_size=V,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=256,
    initializer_range=0.3,  # peaked distributions (entropy ~3 nats), not near-uniform
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def build(kind: str = "llama", seed: int = 0) -> PreTrainedModel:
    """A tiny seeded random model of the given architecture, eval mode, fp32."""
    torch.manual_seed(seed)
    if kind == "llama":
        model: PreTrainedModel = LlamaForCausalLM(LlamaConfig(**SMALL))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=8))
    elif kind == "qwen2_sliding":  # layer 1 slides over 4 tokens, layer 0 is full
        qwen2 = Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=1)
        model = Qwen2ForCausalLM(qwen2)
    elif kind == "mistral_sliding":
        model = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=5))
    elif kind == "gpt2":
        gpt2 = GPT2Config(
            vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=256, initializer_range=0.3
        )
        gpt2.eos_token_id = gpt2.bos_token_id = None
        model = GPT2LMHeadModel(gpt2)
    else:
        raise ValueError(kind)
    return model.eval()


@torch.no_grad()
def reference_logp(
    model: PreTrainedModel, prompt: Sequence[int], tokens: Sequence[int], temperature: float
) -> torch.Tensor:
    """Naive reference: log_softmax(logits / T) of one full forward, at each sampled token."""
    ids = torch.tensor([[*prompt, *tokens]])
    logp = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)
    return logp[len(prompt) - 1 : -1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def generate_all(
    engine: TorchEngine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
) -> list[Completion]:
    """Submit every request at once on a fresh event loop."""

    async def go() -> list[Completion]:
        calls = [engine.generate(p, s) for p, s in zip(prompts, params, strict=True)]
        return list(await asyncio.gather(*calls))

    return asyncio.run(go())


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20]]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2_sliding", "mistral_sliding", "gpt2"])
def test_logprobs_equal_full_forward(kind: str) -> None:
    model = build(kind)
    params = [SamplingParams(temperature=0.7, max_new_tokens=12 + 3 * i, seed=i) for i in range(4)]
    with TorchEngine(model, max_batch_size=3, max_seq_len=64) as engine:
        assert engine.uses_static_kv == (kind != "gpt2")
        results = generate_all(engine, PROMPTS, params)
    for prompt, sp, c in zip(PROMPTS, params, results, strict=True):
        assert c.finish_reason == "length" and len(c.token_ids) == sp.max_new_tokens
        assert c.versions == (0,) * sp.max_new_tokens
        ref = reference_logp(model, prompt, c.token_ids, temperature=0.7)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


def test_top_k_top_p_logprob_is_the_renormalised_truncated_distribution() -> None:
    model = build("llama")
    prompt = [3, 1, 4, 1, 5]
    sp = SamplingParams(temperature=0.8, top_k=6, top_p=0.7, max_new_tokens=1, seed=11)
    with TorchEngine(model, max_batch_size=2, max_seq_len=32) as engine:
        (c,) = generate_all(engine, [prompt], [sp])
    # by hand: sort the T-scaled probabilities, keep the 6 largest, renormalise,
    # keep the prefix whose mass before each token is < 0.7, renormalise again
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / 0.8, -1)
    values, ids = probs.sort(descending=True)
    top6 = values[:6] / values[:6].sum()
    n_keep = sum(1 for i in range(6) if top6[:i].sum() < 0.7)
    kept = top6[:n_keep] / top6[:n_keep].sum()
    assert 1 <= n_keep < 6  # the filters really truncate at this step
    assert c.token_ids[0] in ids[:n_keep].tolist()
    expected = kept[ids[:n_keep].tolist().index(c.token_ids[0])].log().item()
    assert c.logprobs[0] == pytest.approx(expected, abs=1e-5)


def test_continuous_batching_equals_one_at_a_time() -> None:
    model = build("llama")
    prompts = [[i + 1] * (1 + i % 4) for i in range(7)]
    params = [
        SamplingParams(temperature=1.3, max_new_tokens=3 + 5 * i, seed=100 + i) for i in range(7)
    ]
    with TorchEngine(model, max_batch_size=3, max_seq_len=64) as engine:
        together = generate_all(engine, prompts, params)  # 7 requests through 3 slots
        alone = [generate_all(engine, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
    for a, b in zip(together, alone, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_several_event_loops_share_one_engine() -> None:
    model = build("qwen3")
    prompts = [[5, 6, 7], [8], [9, 9]]
    params = [SamplingParams(max_new_tokens=10, seed=s) for s in range(3)]
    with TorchEngine(model, max_batch_size=4, max_seq_len=32) as engine:
        assert isinstance(engine, Engine)
        expected = generate_all(engine, prompts, params)
        outputs: list[list[Completion]] = [[], []]
        threads = [
            threading.Thread(
                target=lambda i=i: outputs[i].extend(generate_all(engine, prompts, params))
            )
            for i in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [c.token_ids for c in outputs[0]] == [c.token_ids for c in expected]
    assert [c.token_ids for c in outputs[1]] == [c.token_ids for c in expected]


def test_engine_owns_a_copy_of_the_weights() -> None:
    model = build("llama")
    sp = SamplingParams(max_new_tokens=8, seed=4)
    with TorchEngine(model, max_seq_len=32) as engine:
        before = generate_all(engine, [[1, 2]], [sp])[0]
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1.0)  # the trainer changes its model in place
        after = generate_all(engine, [[1, 2]], [sp])[0]
    assert after == before


def _update_at_step(
    step: int, state: dict[str, torch.Tensor], version: int
) -> Callable[[TorchEngine], None]:
    """A step callback that updates the weights once, after ``step`` loop steps."""

    def callback(engine: TorchEngine) -> None:
        if engine.steps == step:
            engine.load_weights(state, version)

    return callback


def test_weight_update_keeping_kv() -> None:
    old, new = build("llama", seed=0), build("llama", seed=1)
    prompt, n, T = [2, 7, 1, 8], 16, 0.9
    callback = _update_at_step(6, new.state_dict(), version=3)
    with TorchEngine(old, max_seq_len=64, step_callback=callback) as engine:
        (c,) = generate_all(engine, [prompt], [SamplingParams(temperature=T, max_new_tokens=n)])
        assert engine.version == 3
    j = c.versions.index(3)
    assert 0 < j < n and c.versions == (0,) * j + (3,) * (n - j)
    # Reference computed the same way: the old weights wrote the cache of
    # positions < P + j - 1 (prompt and tokens 0..j-2); token j-1 and later are
    # fed by the new weights on top of that cache (HF DynamicCache).
    ids = torch.tensor([[*prompt, *c.token_ids]])
    cut = len(prompt) + j - 1
    cache_kw = (
        "cache" if "cache" in inspect.signature(old.forward).parameters else "past_key_values"
    )
    with torch.no_grad():
        cache = old(ids[:, :cut], use_cache=True)[cache_kw]
        logits_new = new(ids[:, cut:], **{cache_kw: cache}).logits[0, : n - j]
    ref_new = torch.log_softmax(logits_new / T, -1).gather(-1, ids[0, -(n - j) :, None])[:, 0]
    ref_old = reference_logp(old, prompt, c.token_ids, T)[:j]
    got = torch.tensor(c.logprobs)
    assert torch.allclose(got[:j], ref_old, atol=1e-4, rtol=0)
    assert torch.allclose(got[j:], ref_new, atol=1e-4, rtol=0)
    # the stale cache matters: the new model's full forward gives other values
    full_new = reference_logp(new, prompt, c.token_ids, T)[j:]
    assert (got[j:] - full_new).abs().max() > 1e-3


def test_weight_update_with_kv_recompute() -> None:
    old, new = build("qwen3", seed=0), build("qwen3", seed=1)
    prompts, n, T = [[2, 7, 1, 8], [3, 3]], 14, 1.1
    callback = _update_at_step(5, new.state_dict(), version=1)
    with TorchEngine(old, max_seq_len=64, recompute_kv_on_update=True, step_callback=callback) as e:
        params = [SamplingParams(temperature=T, max_new_tokens=n, seed=s) for s in (0, 1)]
        results = generate_all(e, prompts, params)
    for prompt, c in zip(prompts, results, strict=True):
        j = c.versions.index(1)
        assert 0 < j < n
        got = torch.tensor(c.logprobs)
        ref_old = reference_logp(old, prompt, c.token_ids, T)[:j]
        ref_new = reference_logp(new, prompt, c.token_ids, T)[j:]
        assert torch.allclose(got[:j], ref_old, atol=1e-4, rtol=0)
        assert torch.allclose(got[j:], ref_new, atol=1e-4, rtol=0)


def test_load_weights_from_another_thread_while_running() -> None:
    old, new = build("llama", seed=0), build("llama", seed=1)

    async def go(engine: TorchEngine) -> tuple[Completion, Completion]:
        running = asyncio.create_task(engine.generate([1], SamplingParams(max_new_tokens=150)))
        while engine.num_running == 0:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.load_weights, new.state_dict(), 1)  # blocks until applied
        after = await engine.generate([1], SamplingParams(max_new_tokens=5, seed=0))
        return await running, after

    with TorchEngine(old, max_batch_size=2, max_seq_len=200) as engine:
        during, after = asyncio.run(go(engine))
    assert list(during.versions) == sorted(during.versions) and during.versions[0] == 0
    assert after.versions == (1,) * 5
    assert torch.allclose(
        torch.tensor(after.logprobs), reference_logp(new, [1], after.token_ids, 1.0), atol=1e-4
    )


def test_an_applied_update_is_not_kept() -> None:
    """The engine copies an update into its own weights and keeps no reference to
    it: a Ray worker's update is a deserialised copy of the whole policy, which the
    engine thread's loop variable used to hold until the next update (0.61 GiB a
    worker for SmolLM2)."""
    import gc
    import weakref

    new = build("llama", seed=1)
    with TorchEngine(build("llama", seed=0), max_seq_len=16) as engine:
        for version in (1, 2):
            state = {k: t.detach().clone() for k, t in new.state_dict().items()}
            refs = [weakref.ref(t) for t in state.values()]
            engine.load_weights(state, version)
            del state
            gc.collect()
            assert not [r for r in refs if r() is not None]
        (c,) = generate_all(engine, [[1, 2]], [SamplingParams(max_new_tokens=4, seed=0)])
    assert c.versions == (2,) * 4
    assert torch.allclose(
        torch.tensor(c.logprobs), reference_logp(new, [1, 2], c.token_ids, 1.0), atol=1e-4
    )


def test_load_weights_rejects_unknown_keys_and_shapes() -> None:
    with TorchEngine(build("llama"), max_seq_len=16) as engine:
        with pytest.raises(KeyError, match="not a weight"):
            engine.load_weights({"nope.weight": torch.zeros(2)}, 1)
        with pytest.raises(ValueError, match="shape"):
            engine.load_weights({"lm_head.weight": torch.zeros(2, 2)}, 1)
        assert engine.version == 0
