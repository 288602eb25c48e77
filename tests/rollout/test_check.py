"""The log-probability check: hand-worked report arithmetic, then the whole
check against a tiny random fp32 Llama, sampled by a reference engine (one
full forward pass per token) and by the embedded ``TorchEngine``."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sao.rollout import EpisodeLimits, LogprobReport, check_logprobs
from sao.rollout.check import LOGPROB_BUDGETS, LogprobBudget, compare_logprobs
from sao.types import SamplingParams
from tests.rollout.conftest import IM_END
from tests.rollout.scripted import ModelEngine, ScriptedEnv, done, say

LIMITS = EpisodeLimits(max_turns=2, max_total_tokens=96, step_timeout_s=5, reset_timeout_s=5)


def test_compare_logprobs_by_hand():
    train = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 9.0]])
    rollout = torch.tensor([[0.0, -1.0, -2.5], [0.0, -0.75, 0.0]])
    mask = torch.tensor([[False, True, True], [False, True, False]])
    report = compare_logprobs(train, rollout, mask, num_episodes=2, notes=("n",))
    # log r over action tokens: 0, 0.5, 0.25 (the 9.0 is masked out).
    assert report.max_abs_delta == pytest.approx(0.5)
    assert report.mean_abs_delta == pytest.approx(0.25)
    # k3 = (r - 1) - log r: 0, e^0.5 - 1.5 = 0.148721, e^0.25 - 1.25 = 0.034025.
    assert report.k3_kl == pytest.approx((0.148721 + 0.034025) / 3, abs=1e-6)
    assert (report.num_tokens, report.num_episodes, report.notes) == (3, 2, ("n",))


def test_report_check_passes_or_says_what_differs():
    ok = LogprobReport(1e-6, 1e-7, 0.0, 10, 2)
    assert ok.check(1e-4) is ok
    bad = LogprobReport(0.3, 0.1, 0.02, 10, 2, notes=("sampling uses top_k=5",))
    with pytest.raises(
        RuntimeError, match=r"max \|delta logp\| = 0.3.*budget \(max 0.0001\).*top_k=5"
    ):
        bad.check(1e-4)
    with pytest.raises(RuntimeError, match="no known cause"):
        LogprobReport(0.3, 0.1, 0.02, 10, 2).check(1e-4)
    with pytest.raises(RuntimeError, match="compared no action token"):
        LogprobReport(0.0, 0.0, 0.0, 0, 2).check(1e-4)
    with pytest.raises(ValueError, match="budget"):
        ok.check(-1.0)
    with pytest.raises(ValueError, match="budget"):
        ok.check(LogprobBudget(1.0, float("nan")))


def test_report_check_gates_bfloat16_on_the_kl():
    """bfloat16's budget (max 2, k3 KL 0.01): a gap of 0.72 on one token of many passes
    when the mean KL is small (the CI machine's measurement: k3 2.3e-3); the same max
    with a KL of 0.02, or one token 2.5 away, fails, and a number is a max alone."""
    bf16 = LOGPROB_BUDGETS["bfloat16"][1]
    assert bf16 == LogprobBudget(2.0, 0.01) and str(bf16) == "max 2, k3 KL 0.01"
    noisy = LogprobReport(0.724, 0.0398, 0.00232, 358, 8)
    assert noisy.check(bf16) is noisy
    with pytest.raises(RuntimeError, match=r"k3 KL = 0.02 .*budget \(max 2, k3 KL 0.01\)"):
        LogprobReport(0.724, 0.1, 0.02, 358, 8).check(bf16)
    with pytest.raises(RuntimeError, match="beyond the budget"):
        LogprobReport(2.5, 0.01, 0.001, 358, 8).check(bf16)
    with pytest.raises(RuntimeError, match=r"budget \(max 0.5\)"):
        noisy.check(0.5)


def tiny_llama(vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float().eval()


def envs() -> list[ScriptedEnv]:
    return [
        ScriptedEnv("hi", [say("ok"), done()]),
        ScriptedEnv("hello", [say("go on"), done()]),
        ScriptedEnv("x", [done()]),
    ]


def test_check_with_reference_engine_is_exact(chatml_tok):
    model = tiny_llama(len(chatml_tok))
    engine = ModelEngine(model, eos_id=IM_END, seed=1)
    sampling = SamplingParams(temperature=0.7, max_new_tokens=6)
    report = asyncio.run(check_logprobs(engine, model, chatml_tok, envs(), sampling, LIMITS))
    assert report.num_episodes == 3 and report.num_tokens > 0
    assert report.max_abs_delta <= 1e-4 and report.notes == ()
    assert 0.0 <= report.k3_kl <= 1e-8
    report.check(1e-4)


def test_check_names_top_k_and_stale_version(chatml_tok):
    model = tiny_llama(len(chatml_tok))
    engine = ModelEngine(model, eos_id=IM_END, seed=2)
    sampling = SamplingParams(top_k=3, max_new_tokens=6)
    report = asyncio.run(
        check_logprobs(engine, model, chatml_tok, envs(), sampling, LIMITS, model_version=1)
    )
    # Top-3 renormalisation raises every sampled token's logp above the full softmax's.
    assert report.max_abs_delta > 1e-2 and math.isfinite(report.k3_kl)
    with pytest.raises(
        RuntimeError, match=r"top_k=3.*weight version mismatch.*engine is version 0"
    ):
        report.check(1e-4)


def test_check_with_torch_engine(chatml_tok):
    torch_engine = pytest.importorskip("sao.rollout.embedded.engine")
    model = tiny_llama(len(chatml_tok))
    sampling = SamplingParams(temperature=0.9, max_new_tokens=6)

    async def run(engine: torch_engine.TorchEngine) -> LogprobReport:
        return await check_logprobs(
            engine, model, chatml_tok, envs(), sampling, LIMITS, model_version=0
        )

    with torch_engine.TorchEngine(
        model, max_batch_size=4, max_seq_len=96, tokenizer=chatml_tok
    ) as engine:
        report = asyncio.run(run(engine))
    assert report.num_episodes == 3 and report.num_tokens > 0 and report.notes == ()
    report.check(1e-4)
