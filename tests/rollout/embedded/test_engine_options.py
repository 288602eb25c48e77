"""The embedded engine's bfloat16 weight copy: reported, close to the float32
model, takes float32 weight updates, has its own log-prob budget; refused for servers."""

from __future__ import annotations

import pytest
import torch

from sao.config import ConfigError, load_config
from sao.rollout.check import LogprobBudget, logprob_budget
from sao.rollout.embedded.engine import TorchEngine
from sao.rollout.embedded.layers import Rotary
from sao.types import SamplingParams
from tests.rollout.embedded.test_engine import (
    PROMPTS,
    build,
    generate_all,
    reference_logp,
)


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
    assert 1e-4 < max(deltas) < 0.5  # a bfloat16 gap, not a float32 one; not a bug's
    ref_new = reference_logp(new, PROMPTS[0], after.token_ids, 1.0)
    assert (torch.tensor(after.logprobs) - ref_new).abs().max() < 0.5


def test_logprob_budgets_by_dtype() -> None:
    assert logprob_budget(torch.float32, torch.float32) == LogprobBudget(1e-4)
    assert logprob_budget(torch.float32, torch.float32, training=True) == LogprobBudget(1e-3)
    assert logprob_budget(torch.float32, torch.bfloat16) == LogprobBudget(2.0, 0.01)
    assert logprob_budget(torch.bfloat16, torch.bfloat16, training=True) == LogprobBudget(2.0, 0.01)


def test_engine_options_are_refused_for_servers() -> None:
    with pytest.raises(ConfigError, match="engine_dtype sets the embedded engine"):
        load_config(overrides=["rollout.engine=vllm", "rollout.engine_dtype=bfloat16"])
    cfg = load_config(overrides=["rollout.engine_dtype=bfloat16"])
    assert cfg.rollout.engine_dtype == "bfloat16"


def test_rotary_roll_form_equals_rotate_half() -> None:
    """``x * cos + roll(x) * sin_signed`` is HF's ``x * cos + rotate_half(x) * sin``;
    by hand for D = 4: rotate_half([1, 2, 3, 4]) = [-3, -4, 1, 2]."""
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    cos = torch.zeros(1, 1, 4)
    sin = torch.tensor([1.0, 10.0, 100.0, 1000.0]).view(1, 1, 4)
    got = Rotary.of(cos, sin)(x)
    assert got.flatten().tolist() == [-3.0, -40.0, 100.0, 2000.0]
    x, cos, sin = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    hf = x * cos.unsqueeze(2) + torch.cat((-x[..., 4:], x[..., :4]), -1) * sin.unsqueeze(2)
    assert torch.allclose(Rotary.of(cos, sin)(x), hf, atol=1e-6, rtol=0)
