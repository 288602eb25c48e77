"""Prefix reuse across calls in the embedded engine: a multi-turn episode's
later turns prefill only their new tokens, with the log-probabilities of a full
prefill; weight updates, eviction, compaction and cancellation keep it exact."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest
import torch
from transformers import PreTrainedModel

from sao.rollout.embedded.engine import TorchEngine
from sao.rollout.embedded.kv_forward import StaticKVForward
from sao.rollout.embedded.scheduler import common_prefix
from sao.types import Completion, SamplingParams
from tests.rollout.embedded.test_engine import build, generate_all, reference_logp

T = 0.8
OBSERVATIONS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]
FIRST = [(3 * i + 1) % 60 for i in range(20)]  # longer than the sliding windows (4, 5)


def one(engine: TorchEngine, prompt: Sequence[int], sp: SamplingParams) -> Completion:
    return generate_all(engine, [prompt], [sp])[0]


def converse(
    engine: TorchEngine | Callable[[], TorchEngine],
    first: Sequence[int],
    turns: int = 3,
    n: int = 10,
    seed: int = 0,
) -> list[tuple[list[int], Completion]]:
    """A scripted episode: generate, append the reply and a fixed observation,
    generate again. ``engine`` may be a factory (a fresh engine per turn)."""
    history, out = list(first), []
    for t in range(turns):
        sp = SamplingParams(temperature=T, max_new_tokens=n, seed=seed + t)
        if isinstance(engine, TorchEngine):
            c = one(engine, history, sp)
        else:
            with engine() as fresh:
                c = one(fresh, history, sp)
        out.append((list(history), c))
        history += [*c.token_ids, *OBSERVATIONS[t % len(OBSERVATIONS)]]
    return out


def assert_exact(
    model: PreTrainedModel, turns: Sequence[tuple[Sequence[int], Completion]], atol: float = 1e-4
) -> None:
    """Log-probabilities equal a full forward's (to the tolerance of test_engine.py:
    batched and unbatched matmuls round differently)."""
    for prompt, c in turns:
        ref = reference_logp(model, prompt, c.token_ids, T)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=atol, rtol=0)


def test_common_prefix() -> None:
    assert common_prefix((1, 2, 3), (1, 2, 3, 4)) == 3
    assert common_prefix((1, 2, 3), (1, 2, 9)) == 2
    assert common_prefix((5,), (1, 2)) == 0
    assert common_prefix((), (1,)) == 0
    long = tuple(range(1000))
    assert common_prefix(long, (*long[:613], -1, *long[614:])) == 613


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral_sliding", "qwen2_sliding"])
def test_three_turns_reuse_the_prefix_and_match_a_full_prefill(kind: str) -> None:
    model = build(kind)
    with TorchEngine(model, max_batch_size=2, max_seq_len=128) as engine:
        reused = converse(engine, FIRST)
        prefilled, reused_n = engine.prefill_tokens, engine.reused_tokens
    fresh = converse(lambda: TorchEngine(model, max_batch_size=2, max_seq_len=128), FIRST)
    for (p_a, a), (p_b, b) in zip(reused, fresh, strict=True):
        assert p_a == p_b and a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert_exact(model, reused)
    # turn 1 prefills its 20 tokens; turns 2 and 3 reuse the previous prompt and
    # reply but its last token, and prefill that token and the observation
    (p1, _), (p2, _), (p3, _) = reused
    assert reused_n == (len(p1) + 9) + (len(p2) + 9)
    assert prefilled == len(p1) + (1 + len(OBSERVATIONS[0])) + (1 + len(OBSERVATIONS[1]))
    assert prefilled + reused_n == len(p1) + len(p2) + len(p3)


def test_the_fallback_forward_does_not_reuse() -> None:
    model = build("gpt2")
    with TorchEngine(model, max_batch_size=2, max_seq_len=128) as engine:
        assert not engine.uses_static_kv
        turns = converse(engine, FIRST)
        assert engine.reused_tokens == 0 and engine.num_cached_prefixes == 0
    assert_exact(model, turns)


def test_prefix_cache_off_prefills_everything() -> None:
    model = build("llama")
    with TorchEngine(model, max_batch_size=2, max_seq_len=128, prefix_cache=False) as engine:
        turns = converse(engine, FIRST)
        assert engine.reused_tokens == 0 and engine.num_cached_prefixes == 0
        assert engine.prefill_tokens == sum(len(p) for p, _ in turns)
    assert_exact(model, turns)


@pytest.mark.parametrize("kind", ["llama", "mistral_sliding"])
def test_forward_prefills_rows_with_different_offsets_together(kind: str) -> None:
    """One prefill call: a fresh row and two rows on top of cached prefixes of
    different lengths give the logits of full forwards."""
    model = build(kind)
    seqs = [FIRST, FIRST[3:16], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    forward = StaticKVForward(model, max_batch_size=4, max_seq_len=32)
    forward.prefill([3, 1], [seqs[0][:12], seqs[1][:5]])
    forward.move(3, 0, 12)  # a prefix reused from another slot
    logits_NV = forward.prefill([0, 1, 2], [seqs[0][12:], seqs[1][5:], seqs[2]], [12, 5, 0])
    with torch.no_grad():
        ref = torch.stack([model(torch.tensor([s])).logits[0, -1] for s in seqs])
    assert torch.allclose(logits_NV, ref, atol=1e-5, rtol=0)
    # decoding on top of the offset prefill stays exact
    logits_NV = forward.decode([0, 1], [4, 4], [len(seqs[0]), len(seqs[1])])
    with torch.no_grad():
        ref = torch.stack([model(torch.tensor([[*s, 4]])).logits[0, -1] for s in seqs[:2]])
    assert torch.allclose(logits_NV, ref, atol=1e-5, rtol=0)


def test_concurrent_episodes_each_reuse_their_own_history() -> None:
    model = build("qwen3")
    firsts = [FIRST, [*FIRST[:17], 2, 4]]  # the second shares 17 tokens with the first
    n = [6, 9, 7]
    with TorchEngine(model, max_batch_size=4, max_seq_len=128) as engine:
        histories = [list(f) for f in firsts]
        expected = 0
        for t in range(3):
            params = [SamplingParams(temperature=T, max_new_tokens=n[i], seed=i) for i in range(3)]
            prompts = [*histories, [40 + t, 41, 42]]  # and one new prompt per turn
            results = generate_all(engine, prompts, params)
            assert_exact(model, list(zip(prompts, results, strict=True)))
            if t > 0:
                expected += sum(len(h) - len(OBSERVATIONS[t - 1]) - 1 for h in histories)
            for h, c in zip(histories, results[:2], strict=True):
                h += [*c.token_ids, *OBSERVATIONS[t]]
        assert engine.reused_tokens == expected > 0


def test_no_stale_reuse_after_a_weight_update() -> None:
    old, new = build("llama", seed=0), build("llama", seed=1)
    sp = SamplingParams(temperature=T, max_new_tokens=8, seed=3)
    with TorchEngine(old, max_batch_size=2, max_seq_len=128) as engine:
        c1 = one(engine, FIRST, sp)
        assert engine.num_cached_prefixes == 1
        engine.load_weights(new.state_dict(), 1)
        assert engine.num_cached_prefixes == 0
        p2 = [*FIRST, *c1.token_ids, *OBSERVATIONS[0]]
        c2 = one(engine, p2, sp)
        assert engine.reused_tokens == 0 and engine.prefill_tokens == len(FIRST) + len(p2)
        assert c2.versions == (1,) * 8
        assert_exact(new, [(p2, c2)])


def test_a_request_spanning_an_update_is_not_parked() -> None:
    old, new = build("llama", seed=0), build("llama", seed=1)

    def callback(engine: TorchEngine) -> None:
        if engine.steps == 3:
            engine.load_weights(new.state_dict(), 1)

    sp = SamplingParams(temperature=T, max_new_tokens=10, seed=3)
    with TorchEngine(old, max_batch_size=2, max_seq_len=128, step_callback=callback) as engine:
        c1 = one(engine, FIRST, sp)
        assert 0 in c1.versions and 1 in c1.versions
        assert engine.num_cached_prefixes == 0  # its cache mixes old and new keys
        p2 = [*FIRST, *c1.token_ids, *OBSERVATIONS[0]]
        c2 = one(engine, p2, sp)
        assert engine.reused_tokens == 0
        assert_exact(new, [(p2, c2)])


def test_reuse_stale_prefix_keeps_caches_across_updates() -> None:
    old, new = build("llama", seed=0), build("llama", seed=1)
    with pytest.raises(ValueError, match="recompute_kv_on_update"):
        TorchEngine(old, reuse_stale_prefix=True, recompute_kv_on_update=True)
    sp = SamplingParams(temperature=T, max_new_tokens=8, seed=3)
    with TorchEngine(old, max_batch_size=2, max_seq_len=128, reuse_stale_prefix=True) as engine:
        c1 = one(engine, FIRST, sp)
        engine.load_weights(new.state_dict(), 1)
        one(engine, [*FIRST, *c1.token_ids, *OBSERVATIONS[0]], sp)
        assert engine.reused_tokens == len(FIRST) + 7


def test_eviction_is_least_recently_used() -> None:
    model = build("mistral_sliding")
    sp = SamplingParams(temperature=T, max_new_tokens=6, seed=1)
    firsts = {name: [k, *FIRST[1:]] for name, k in zip("abc", (50, 51, 52), strict=True)}
    history = {name: list(f) for name, f in firsts.items()}
    with TorchEngine(model, max_batch_size=2, max_seq_len=128) as engine:

        def turn(name: str) -> int:
            """One turn of episode ``name``; returns the prompt tokens it reused."""
            before = engine.reused_tokens
            c = one(engine, history[name], sp)
            assert_exact(model, [(history[name], c)])
            history[name] += [*c.token_ids, *OBSERVATIONS[0]]
            return engine.reused_tokens - before

        assert [turn("a"), turn("b"), turn("c")] == [0, 0, 0]  # c evicts a
        assert engine.num_cached_prefixes == 2
        assert turn("b") > 0  # b is parked again, more recently used than c
        assert turn("a") == 0  # a was evicted; it evicts c
        assert turn("b") > 0 and turn("c") == 0


def test_max_cached_prefixes_caps_parked_slots() -> None:
    model = build("llama")
    sp = SamplingParams(temperature=T, max_new_tokens=4, seed=1)
    with TorchEngine(model, max_batch_size=4, max_seq_len=128, max_cached_prefixes=1) as engine:
        a = one(engine, [50, *FIRST], sp)
        one(engine, [51, *FIRST], sp)  # shares no first token with a: parks and evicts a
        assert engine.num_cached_prefixes == 1
        one(engine, [50, *FIRST, *a.token_ids], sp)
        assert engine.reused_tokens == 0
    with pytest.raises(ValueError, match="max_cached_prefixes"):
        TorchEngine(model, max_cached_prefixes=-1)


def test_a_shared_beginning_is_copied_and_the_parked_cache_stays() -> None:
    model = build("qwen2_sliding")
    sp = SamplingParams(temperature=T, max_new_tokens=5, seed=2)
    with TorchEngine(model, max_batch_size=3, max_seq_len=128) as engine:
        a = one(engine, FIRST, sp)
        other = [*FIRST[:18], 33, 34, 35]
        b = one(engine, other, sp)  # shares 18 tokens with a's cache
        assert engine.reused_tokens == 18 and engine.num_cached_prefixes == 2
        p2 = [*FIRST, *a.token_ids, *OBSERVATIONS[0]]
        a2 = one(engine, p2, sp)  # a's own cache is still there
        assert engine.reused_tokens == 18 + len(FIRST) + 4
    assert_exact(model, [(FIRST, a), (other, b), (p2, a2)])


def test_reuse_while_others_decode_across_compaction() -> None:
    """A short episode finishes in slot 0 while two long requests run in higher
    slots: compaction swaps its parked cache out of the decode range, and its
    next turn reuses it from there while the long requests keep decoding."""
    model = build("qwen3")
    long_sp = [SamplingParams(temperature=T, max_new_tokens=200, seed=s) for s in (7, 8)]
    short = SamplingParams(temperature=T, max_new_tokens=3, seed=9)
    longs_p = [[20, 21, 22], [23, 24]]

    async def go(engine: TorchEngine) -> tuple[list[Completion], Completion, Completion, int]:
        first = asyncio.ensure_future(engine.generate(FIRST, short))
        pairs = zip(longs_p, long_sp, strict=True)
        longs = [asyncio.ensure_future(engine.generate(p, s)) for p, s in pairs]
        x1 = await first
        x2 = await engine.generate([*FIRST, *x1.token_ids, *OBSERVATIONS[0]], short)
        return list(await asyncio.gather(*longs)), x1, x2, engine.reused_tokens

    with TorchEngine(model, max_batch_size=3, max_seq_len=256) as engine:
        longs, x1, x2, reused = asyncio.run(go(engine))
    assert reused == len(FIRST) + 2
    p2 = [*FIRST, *x1.token_ids, *OBSERVATIONS[0]]
    assert_exact(model, [(FIRST, x1), (p2, x2), *zip(longs_p, longs, strict=True)])


def test_cancelled_and_aborted_requests_are_not_parked() -> None:
    model = build("llama")

    async def go(engine: TorchEngine) -> Completion:
        task = asyncio.ensure_future(engine.generate(FIRST, SamplingParams(max_new_tokens=200)))
        while engine.num_running == 0:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        aborted = asyncio.ensure_future(engine.generate(FIRST, SamplingParams(max_new_tokens=200)))
        while engine.num_running == 0:
            await asyncio.sleep(0.001)
        engine.abort_all()
        return await aborted

    with TorchEngine(model, max_batch_size=2, max_seq_len=256) as engine:
        assert asyncio.run(go(engine)).finish_reason == "aborted"
        assert engine.num_cached_prefixes == 0
        c = one(engine, FIRST, SamplingParams(temperature=T, max_new_tokens=4))
        assert engine.reused_tokens == 0 and engine.num_cached_prefixes == 1
    assert_exact(model, [(FIRST, c)])
