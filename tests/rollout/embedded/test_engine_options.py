"""The embedded engine's speed options: compiled layer kernels (exact, updated
in flight, eager when compiling fails) and a bfloat16 weight copy (reported,
with its own log-prob budget)."""

from __future__ import annotations

import logging

import pytest
import torch

from sao.config import ConfigError, load_config
from sao.rollout.check import logprob_budget
from sao.rollout.embedded import layers
from sao.rollout.embedded.engine import TorchEngine
from sao.rollout.embedded.kv_forward import StaticKVForward
from sao.types import SamplingParams
from tests.rollout.embedded.test_engine import (
    PROMPTS,
    _update_at_step,
    build,
    generate_all,
    reference_logp,
)


@pytest.mark.slow
@pytest.mark.timeout(900)  # compiling on a busy 2-core machine: ~40 s measured
def test_compiled_kernels_are_exact_and_take_weight_updates(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Qwen3 (q/k norms, grouped kv heads): prefill and decode at batch 1 and
    above give a full forward's logits; in the engine, tokens after an in-flight
    weight update have the new weights' log-probs (recomputed cache)."""
    caplog.set_level(logging.INFO, logger=layers.__name__)
    old, new = build("qwen3", seed=0), build("qwen3", seed=1)
    forward = StaticKVForward(old, max_batch_size=3, max_seq_len=32, compile=True)
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    forward.prefill([0, 1], seqs)
    forward.prefill([2], [[10, 11]])
    got_NV = torch.cat(
        [forward.decode([0, 1, 2], [4, 4, 4], [6, 3, 2]), forward.decode([0], [5], [7])]
    )
    with torch.no_grad():
        ref_NV = torch.stack(
            [
                old(torch.tensor([s])).logits[0, -1]
                for s in ([*seqs[0], 4], [*seqs[1], 4], [10, 11, 4])
            ]
            + [old(torch.tensor([[*seqs[0], 4, 5]])).logits[0, -1]]
        )
    assert forward.kernels.compiled and forward.kernels.compile_s > 0
    assert torch.allclose(got_NV, ref_NV, atol=1e-5, rtol=0)
    compiled = [r.getMessage() for r in caplog.records if "compiled" in r.getMessage()]
    assert len(compiled) == 8  # 2 kernels x batch (1, > 1) x length (1, > 1)

    T, n = 1.1, 12
    callback = _update_at_step(5, new.state_dict(), version=1)
    with TorchEngine(
        old, max_seq_len=64, recompute_kv_on_update=True, step_callback=callback, compile=True
    ) as engine:
        params = [SamplingParams(temperature=T, max_new_tokens=n, seed=s) for s in (0, 1)]
        results = generate_all(engine, PROMPTS[:2], params)
    for prompt, c in zip(PROMPTS[:2], results, strict=True):
        j = c.versions.index(1)
        assert 0 < j < n
        got = torch.tensor(c.logprobs)
        assert torch.allclose(got[:j], reference_logp(old, prompt, c.token_ids, T)[:j], atol=1e-4)
        assert torch.allclose(got[j:], reference_logp(new, prompt, c.token_ids, T)[j:], atol=1e-4)


def test_a_failing_compile_falls_back_to_eager_with_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(fn: object, **_: object) -> object:
        def run(*args: object) -> object:
            raise RuntimeError("no C++ compiler")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    model = build("llama")
    params = [SamplingParams(temperature=0.7, max_new_tokens=6, seed=i) for i in range(2)]
    with TorchEngine(model, max_batch_size=2, max_seq_len=32, compile=True) as engine:
        results = generate_all(engine, PROMPTS[:2], params)
        assert not engine._sched.forward.kernels.compiled  # type: ignore[attr-defined]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0].getMessage()
    for prompt, c in zip(PROMPTS[:2], results, strict=True):
        ref = reference_logp(model, prompt, c.token_ids, 0.7)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


def test_bfloat16_copy_decodes_close_to_the_float32_model() -> None:
    """A bfloat16 engine over a float32 model: reported as bfloat16, its log-probs
    near the float32 ones (within bfloat16's budget, not float32's), and a
    float32 weight update lands converted."""
    model, new = build("llama", seed=0), build("llama", seed=1)
    params = [SamplingParams(temperature=1.0, max_new_tokens=10, seed=i) for i in range(4)]
    with TorchEngine(model, max_batch_size=4, max_seq_len=64, dtype=torch.bfloat16) as engine:
        assert engine.dtype == torch.bfloat16
        results = generate_all(engine, PROMPTS, params)
        engine.load_weights(new.state_dict(), version=1)
        (after,) = generate_all(engine, PROMPTS[:1], params[:1])
    deltas = [
        (torch.tensor(c.logprobs) - reference_logp(model, p, c.token_ids, 1.0)).abs().max()
        for p, c in zip(PROMPTS, results, strict=True)
    ]
    assert 1e-4 < max(deltas) < logprob_budget(torch.bfloat16)
    ref_new = reference_logp(new, PROMPTS[0], after.token_ids, 1.0)
    assert (torch.tensor(after.logprobs) - ref_new).abs().max() < logprob_budget(torch.bfloat16)


def test_logprob_budgets_by_dtype() -> None:
    assert logprob_budget(torch.float32, torch.float32) == 1e-4
    assert logprob_budget(torch.float32, torch.float32, training=True) == 1e-3
    assert logprob_budget(torch.float32, torch.bfloat16) == 0.5
    assert logprob_budget(torch.bfloat16, torch.bfloat16, training=True) == 0.5


def test_engine_options_are_refused_for_servers() -> None:
    with pytest.raises(ConfigError, match="engine_dtype and engine_compile"):
        load_config(overrides=["rollout.engine=vllm", "rollout.engine_dtype=bfloat16"])
    cfg = load_config(overrides=["rollout.engine_dtype=bfloat16", "rollout.engine_compile=true"])
    assert cfg.rollout.engine_dtype == "bfloat16" and cfg.rollout.engine_compile
