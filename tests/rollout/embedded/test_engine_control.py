"""The engine's stopping rules, cancellation, abort, shutdown and input checks."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM

from sao.rollout.embedded.engine import TorchEngine
from sao.types import Completion, SamplingParams

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?ABCDEFGHIJKLMNOPQRSTUVW"  # 64 characters


def tiny_llama(seed: int = 0, eos: int | None = None) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(CHARS),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=4096,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def char_tokenizer() -> Tokenizer:
    """One token per character of CHARS; decode concatenates."""
    tok = Tokenizer(models.WordLevel({ch: i for i, ch in enumerate(CHARS)}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


def run(engine: TorchEngine, prompt: list[int], sampling: SamplingParams) -> Completion:
    async def go() -> Completion:
        return await engine.generate(prompt, sampling)

    return asyncio.run(go())


PROMPT = [1, 2, 3]


def test_stop_token_ids_end_with_the_stop_token_kept() -> None:
    with TorchEngine(tiny_llama(), max_seq_len=64) as engine:
        free = run(engine, PROMPT, SamplingParams(max_new_tokens=30, seed=5))
        stop = free.token_ids[4]
        first = free.token_ids.index(stop)
        stopped = run(
            engine, PROMPT, SamplingParams(max_new_tokens=30, seed=5, stop_token_ids=(stop,))
        )
    assert free.finish_reason == "length" and len(free.token_ids) == 30
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]  # the stop token is kept
    assert stopped.logprobs == pytest.approx(free.logprobs[: first + 1], abs=1e-6)


def test_eos_from_model_config_when_no_stop_ids() -> None:
    with TorchEngine(tiny_llama(), max_seq_len=64) as engine:
        free = run(engine, PROMPT, SamplingParams(max_new_tokens=30, seed=6))
    eos = free.token_ids[3]
    with TorchEngine(tiny_llama(eos=eos), max_seq_len=64) as engine:
        assert engine.eos_token_ids == (eos,)
        stopped = run(engine, PROMPT, SamplingParams(max_new_tokens=30, seed=6))
        # explicit stop ids replace the eos ids
        other = run(engine, PROMPT, SamplingParams(max_new_tokens=30, seed=6, stop_token_ids=(63,)))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    assert eos in other.token_ids[: free.token_ids.index(eos) + 1]
    assert len(other.token_ids) > len(stopped.token_ids)


def test_stop_strings_with_a_char_tokenizer() -> None:
    tok = char_tokenizer()
    with TorchEngine(tiny_llama(), max_seq_len=64, tokenizer=tok) as engine:
        free = run(engine, PROMPT, SamplingParams(max_new_tokens=30, seed=7))
        text = tok.decode(list(free.token_ids))
        assert len(text) == 30  # one character per token
        needle = text[10:12]
        end = text.index(needle) + len(needle)  # first occurrence, in characters = tokens
        sp = SamplingParams(max_new_tokens=30, seed=7, stop_strings=("zzzz", needle))
        stopped = run(engine, PROMPT, sp)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:end]  # tokens kept up to the match
    assert tok.decode(list(stopped.token_ids)).endswith(needle)


def test_max_new_tokens_and_context_clamp_finish_with_length() -> None:
    with TorchEngine(tiny_llama(), max_seq_len=16) as engine:
        short = run(engine, PROMPT, SamplingParams(max_new_tokens=4))
        # 10 prompt tokens leave room for 6 of the 100 asked for
        clamped = run(engine, list(range(10)), SamplingParams(max_new_tokens=100))
    assert (len(short.token_ids), short.finish_reason) == (4, "length")
    assert (len(clamped.token_ids), clamped.finish_reason) == (6, "length")


def test_bad_input_is_rejected_with_a_clear_error() -> None:
    async def go(engine: TorchEngine) -> None:
        with pytest.raises(ValueError, match="max_seq_len=16"):
            await engine.generate(list(range(16)), SamplingParams())
        with pytest.raises(ValueError, match="prompt_ids is empty"):
            await engine.generate([], SamplingParams())
        with pytest.raises(ValueError, match=r"\[0, 64\)"):
            await engine.generate([1, 64], SamplingParams())
        with pytest.raises(ValueError, match="needs a tokenizer"):
            await engine.generate([1], SamplingParams(stop_strings=("a",)))
        with pytest.raises(TypeError, match="SamplingParams"):
            await engine.generate([1], {"temperature": 1.0})  # type: ignore[arg-type]
        # the engine still serves after refusing bad calls
        assert len((await engine.generate([1], SamplingParams(max_new_tokens=3))).token_ids) == 3

    with TorchEngine(tiny_llama(), max_seq_len=16) as engine:
        asyncio.run(go(engine))


async def _wait_running(engine: TorchEngine, n: int) -> None:
    while engine.num_running < n:
        await asyncio.sleep(0.001)


def test_cancellation_frees_the_slot_and_others_continue() -> None:
    long_sp = SamplingParams(max_new_tokens=4000, seed=1)
    short_sp = SamplingParams(max_new_tokens=20, seed=2)

    async def go(engine: TorchEngine) -> tuple[Completion, Completion]:
        long = asyncio.create_task(engine.generate(PROMPT, long_sp))
        other = asyncio.create_task(engine.generate([4, 5], short_sp))
        await _wait_running(engine, 2)
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
        waiting = asyncio.create_task(engine.generate([6], short_sp))
        return await other, await waiting

    with TorchEngine(tiny_llama(), max_batch_size=2, max_seq_len=4096) as engine:
        other, waiting = asyncio.run(go(engine))
        reference = run(engine, [4, 5], short_sp)
        # the cancelled request left its slot: nothing runs, and far fewer steps
        # than its 4000 tokens ran
        assert engine.num_running == 0
        assert engine.steps < 1000
    assert other.token_ids == reference.token_ids and other.finish_reason == "length"
    assert len(waiting.token_ids) == 20


def test_abort_all_and_close() -> None:
    async def go(engine: TorchEngine) -> Completion:
        long = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_new_tokens=4000)))
        await _wait_running(engine, 1)
        engine.abort_all()
        return await long

    engine = TorchEngine(tiny_llama(), max_batch_size=1, max_seq_len=4096)
    aborted = asyncio.run(go(engine))
    assert aborted.finish_reason == "aborted" and 0 < len(aborted.token_ids) < 4000
    assert len(aborted.logprobs) == len(aborted.versions) == len(aborted.token_ids)
    assert run(engine, PROMPT, SamplingParams(max_new_tokens=2)).finish_reason == "length"

    async def close_while_running() -> Completion:
        long = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_new_tokens=4000)))
        await _wait_running(engine, 1)
        await engine.aclose()
        return await long

    assert asyncio.run(close_while_running()).finish_reason == "aborted"
    assert engine.closed
    with pytest.raises(RuntimeError, match="closed"):
        run(engine, PROMPT, SamplingParams())
    with pytest.raises(RuntimeError, match="closed"):
        engine.load_weights({}, 1)
