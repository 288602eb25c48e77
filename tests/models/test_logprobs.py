"""sequence_logprobs against a naive full log-softmax reference."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from sao.models import (
    position_ids_from_mask,
    sequence_logprobs,
    sequence_logprobs_and_entropy,
)
from tests.models.conftest import ARCH_CONFIGS, V, make_arch_model


def reference_logprobs(model, tokens_BT, mask_BT, temperature=1.0):
    """Naive: full [B, T, V] logits from the model's own forward, log-softmax,
    shift by one, zero where token t or token t-1 is padding."""
    logits_BTV = model(
        input_ids=tokens_BT,
        attention_mask=mask_BT.long(),
        position_ids=position_ids_from_mask(mask_BT),
    ).logits.float()
    logp_BTV = torch.log_softmax(logits_BTV / temperature, dim=-1)
    out_BT = torch.zeros(tokens_BT.shape)
    out_BT[:, 1:] = logp_BTV[:, :-1].gather(-1, tokens_BT[:, 1:, None]).squeeze(-1)
    valid_BT = torch.zeros_like(mask_BT)
    valid_BT[:, 1:] = mask_BT[:, 1:] & mask_BT[:, :-1]
    return torch.where(valid_BT, out_BT, torch.zeros_like(out_BT))


def padded_batch(lengths, T, *, left, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens_BT = torch.randint(0, V, (len(lengths), T), generator=g)
    mask_BT = torch.zeros((len(lengths), T), dtype=torch.bool)
    for b, n in enumerate(lengths):
        if left:
            mask_BT[b, T - n :] = True
        else:
            mask_BT[b, :n] = True
    return tokens_BT, mask_BT


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
def test_matches_reference_forward_and_gradient(left, temperature, chunk_size):
    # Rows of 9, 6 and 3 real tokens in T = 9 -> 8 + 5 + 2 = 15 scored positions;
    # chunk sizes 1 and 5 split them unevenly against B*T = 27.
    model = make_arch_model("llama")
    tokens_BT, mask_BT = padded_batch([9, 6, 3], 9, left=left)
    ours = sequence_logprobs(
        model, tokens_BT, mask_BT, temperature=temperature, chunk_size=chunk_size
    )
    ref = reference_logprobs(model, tokens_BT, mask_BT, temperature)
    assert ours.dtype == torch.float32 and ours.shape == (3, 9)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    assert int((ours != 0).sum()) == 15
    # Gradient of a weighted sum equals the reference gradient.
    w_BT = torch.linspace(-1.0, 2.0, 27).view(3, 9)
    g_ours = torch.autograd.grad((ours * w_BT).sum(), list(model.parameters()))
    g_ref = torch.autograd.grad((ref * w_BT).sum(), list(model.parameters()))
    for a, b in zip(g_ours, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_first_real_token_and_padding_get_zero():
    # Left padding: row 0 = [pad, pad, x, y, z] -> entries 0, 0, 0 (first real), lp, lp.
    model = make_arch_model("llama")
    tokens_BT, mask_BT = padded_batch([3, 5], 5, left=True)
    logp_BT = sequence_logprobs(model, tokens_BT, mask_BT)
    assert logp_BT[0, :3].eq(0).all() and (logp_BT[0, 3:] < 0).all()
    assert logp_BT[1, 0] == 0 and (logp_BT[1, 1:] < 0).all()


def test_left_and_right_padding_agree():
    # The same sequences, padded on either side, give the same per-token values.
    model = make_arch_model("qwen3")
    tok_r, mask_r = padded_batch([7, 4], 7, left=False, seed=3)
    tok_l = torch.zeros_like(tok_r)
    tok_l[0] = tok_r[0]
    tok_l[1, 3:] = tok_r[1, :4]
    mask_l = mask_r.flip(-1)
    right = sequence_logprobs(model, tok_r, mask_r)
    left = sequence_logprobs(model, tok_l, mask_l)
    torch.testing.assert_close(right[1, :4], left[1, 3:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(right[0], left[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("arch", ["gemma2", "gpt2", "gpt_neox"])
def test_other_layouts_match_reference(arch):
    # Gemma 2 soft-caps its logits; GPT-2 and GPT-NeoX name their heads differently.
    model = make_arch_model(arch)
    tokens_BT, mask_BT = padded_batch([6, 4], 6, left=False)
    ours = sequence_logprobs(model, tokens_BT, mask_BT, chunk_size=3)
    torch.testing.assert_close(
        ours, reference_logprobs(model, tokens_BT, mask_BT), atol=1e-6, rtol=1e-6
    )


def test_entropy_matches_reference():
    model = make_arch_model("llama")
    tokens_BT, mask_BT = padded_batch([5, 2], 5, left=False)
    logp_BT, ent_BT = sequence_logprobs_and_entropy(
        model, tokens_BT, mask_BT, temperature=1.3, chunk_size=2
    )
    logits_BTV = model(input_ids=tokens_BT, attention_mask=mask_BT.long()).logits / 1.3
    p_BTV = torch.softmax(logits_BTV, -1)
    ref_BT = -(p_BTV * torch.log_softmax(logits_BTV, -1)).sum(-1)
    # Entry t describes the distribution token t was drawn from (logits at t-1).
    torch.testing.assert_close(ent_BT[0, 1:], ref_BT[0, :-1], atol=1e-5, rtol=1e-5)
    assert ent_BT[1, 1] > 0 and ent_BT[1, 2:].eq(0).all() and ent_BT[:, 0].eq(0).all()
    assert bool((ent_BT <= math.log(V) + 1e-5).all())
    torch.testing.assert_close(
        logp_BT, sequence_logprobs(model, tokens_BT, mask_BT, temperature=1.3)
    )


def test_uniform_model_gives_minus_log_v():
    # A zero LM head gives uniform next-token probabilities 1/V, whatever the
    # temperature: every scored entry is -log(64) = -4.158883, entropy log(64).
    model = make_arch_model("llama")
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()
    tokens_BT, mask_BT = padded_batch([4], 4, left=False)
    logp_BT, ent_BT = sequence_logprobs_and_entropy(model, tokens_BT, mask_BT, temperature=0.5)
    expected = torch.tensor([[0.0, -math.log(64), -math.log(64), -math.log(64)]])
    torch.testing.assert_close(logp_BT, expected)
    torch.testing.assert_close(ent_BT, -expected)


@settings(max_examples=8, deadline=None)
@given(
    chunk_size=st.integers(1, 40),
    lengths=st.lists(st.integers(1, 8), min_size=1, max_size=3),
)
def test_chunk_size_never_changes_the_result(chunk_size, lengths):
    model = make_arch_model("llama")
    tokens_BT, mask_BT = padded_batch(lengths, 8, left=False)
    with torch.no_grad():
        a = sequence_logprobs(model, tokens_BT, mask_BT, chunk_size=chunk_size)
        b = sequence_logprobs(model, tokens_BT, mask_BT, chunk_size=10_000)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert bool((a <= 0).all())


def test_fully_padded_row_is_zero_and_gradients_finite():
    model = make_arch_model("llama")
    tokens_BT, mask_BT = padded_batch([5, 0], 5, left=False)
    logp_BT = sequence_logprobs(model, tokens_BT, mask_BT)
    assert logp_BT[1].eq(0).all()
    logp_BT.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
)
def test_bad_arguments(kwargs, match):
    model = make_arch_model("llama")
    tokens_BT, mask_BT = padded_batch([3], 3, left=False)
    with pytest.raises(ValueError, match=match):
        sequence_logprobs(model, tokens_BT, mask_BT, **kwargs)


def test_bad_tensors():
    model = make_arch_model("llama")
    tokens_BT, mask_BT = padded_batch([3, 3], 4, left=False)
    with pytest.raises(ValueError, match="tokens_BT must be"):
        sequence_logprobs(model, tokens_BT[0], mask_BT[0])
    with pytest.raises(ValueError, match="attention_mask_BT has shape"):
        sequence_logprobs(model, tokens_BT, mask_BT[:, :3])
    with pytest.raises(ValueError, match="integer token ids"):
        sequence_logprobs(model, tokens_BT.float(), mask_BT)
    gappy = torch.tensor([[True, False, True, True], [True, True, True, True]])
    with pytest.raises(ValueError, match="row 0 has gaps"):
        sequence_logprobs(model, tokens_BT, gappy)


def test_head_runs_in_chunks_and_is_recomputed_in_backward():
    # 2 rows x 9 tokens -> 16 scored positions; chunk_size 4 -> 4 head calls of
    # at most 4 positions forward, and 4 more in backward (checkpoint recompute),
    # so the [16, V] logits never exist at once.
    model = make_arch_model("llama")
    tokens_BT, mask_BT = padded_batch([9, 9], 9, left=False)
    sequence_logprobs(model, tokens_BT[:, :2], mask_BT[:, :2])  # head check runs once
    shapes = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda mod, inp, out: shapes.append(tuple(out.shape))
    )
    logp_BT = sequence_logprobs(model, tokens_BT, mask_BT, chunk_size=4)
    assert shapes == [(4, V)] * 4
    logp_BT.sum().backward()
    hook.remove()
    assert shapes == [(4, V)] * 8


def test_large_vocabulary_in_small_chunks():
    # A 150k vocabulary with chunks of 8 positions: 8 x 150k logits at a time.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = tf.LlamaConfig(
            vocab_size=150_000,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
        model = tf.AutoModelForCausalLM.from_config(config).eval()
    tokens_BT = torch.randint(0, 150_000, (2, 12))
    mask_BT = torch.ones(2, 12, dtype=torch.bool)
    ours = sequence_logprobs(model, tokens_BT, mask_BT, chunk_size=8)
    torch.testing.assert_close(
        ours, reference_logprobs(model, tokens_BT, mask_BT), atol=1e-6, rtol=1e-6
    )


class _DoubledLogits(tf.LlamaForCausalLM):
    """A causal LM whose forward scales logits in a way the head code does not know."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out


def test_unknown_logit_transform_is_an_error():
    model = _DoubledLogits(ARCH_CONFIGS["llama"]()).eval()
    tokens_BT, mask_BT = padded_batch([3], 3, left=False)
    with pytest.raises(ValueError, match=r"does not reproduce the logits of _DoubledLogits"):
        sequence_logprobs(model, tokens_BT, mask_BT)


def test_head_check_keeps_the_module_modes():
    model = make_arch_model("llama").train()
    model.model.layers[0].eval()  # a mixed state must survive the one-time head check
    tokens_BT, mask_BT = padded_batch([3], 3, left=False)
    sequence_logprobs(model, tokens_BT, mask_BT)
    assert model.training and model.model.training and not model.model.layers[0].training
