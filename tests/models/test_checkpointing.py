"""Activation checkpointing of decoder layers (sao.models.checkpointing): the
same log-probs and gradients, less saved for the backward, and a deep copy (the
embedded engine's) that computes with its own weights."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from sao.models.checkpointing import checkpoint_layers
from sao.models.freeze import freeze_below
from sao.models.logprobs import sequence_logprobs
from sao.models.tiny import build_tiny_policy
from sao.models.tokenization import build_char_tokenizer
from sao.models.value import ValueModel


def _policy() -> nn.Module:
    tok = build_char_tokenizer(alphabet="abcdefgh \n")
    return build_tiny_policy(tok, size="0.5m", seed=1)


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (3, 20), generator=g)
    mask = torch.ones_like(tokens)
    mask[1, 15:] = 0  # a padded row
    return tokens, mask


def _grads(model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    logp = sequence_logprobs(model, tokens, mask)  # type: ignore[arg-type]
    (logp * torch.linspace(-1, 1, logp.shape[1])).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _saved_bytes(model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> int:
    total = 0

    def pack(x: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += x.numel() * x.element_size()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        sequence_logprobs(model, tokens, mask)  # type: ignore[arg-type]
    return total


def test_same_gradients_and_less_saved() -> None:
    plain = _policy()
    ckpt = copy.deepcopy(plain)
    assert checkpoint_layers(ckpt) == 3  # the 0.5m model's three decoder layers
    assert checkpoint_layers(ckpt) == 3  # a second call wraps nothing twice
    tokens, mask = _batch(plain.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(
            sequence_logprobs(plain, tokens, mask), sequence_logprobs(ckpt, tokens, mask)
        )
    want, got = _grads(plain, tokens, mask), _grads(ckpt, tokens, mask)
    assert want.keys() == got.keys() and len(want) > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    # the layers' activations are not kept: what autograd saves is well under half
    assert _saved_bytes(ckpt, tokens, mask) < 0.5 * _saved_bytes(plain, tokens, mask)


def test_a_deep_copy_computes_with_its_own_weights() -> None:
    """The engine deep-copies the policy after checkpointing: the copy's layers must
    run the copy's weights, not the original's."""
    policy = _policy()
    checkpoint_layers(policy)
    twin = copy.deepcopy(policy)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(0.05)
    tokens, mask = _batch(policy.config.vocab_size)
    with torch.no_grad():
        a, b = sequence_logprobs(policy, tokens, mask), sequence_logprobs(twin, tokens, mask)
    assert not torch.allclose(a, b)
    # and with gradients on, the twin's gradients land on the twin's parameters
    _grads(twin, tokens, mask)
    assert all(p.grad is None for p in policy.parameters())


def test_critic_values_unchanged() -> None:
    critic = ValueModel(_policy().model, None)
    ckpt = copy.deepcopy(critic)
    checkpoint_layers(ckpt)
    tokens, mask = _batch(critic.backbone.config.vocab_size)
    torch.testing.assert_close(ckpt(tokens, mask), critic(tokens, mask))
    ckpt(tokens, mask).sum().backward()
    assert ckpt.value_head.weight.grad is not None


def test_a_model_without_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="activation_checkpointing"):
        checkpoint_layers(nn.Linear(2, 2))


def test_packed_rows_recompute_with_the_packed_attention() -> None:
    """A packed forward (rows told apart by restarting position ids, attention row
    by row) is recomputed in the backward with the same attention, after the
    packed forward's context has closed: the gradients are the padded forward's
    (a recompute with dense attention would let rows attend across each other)."""
    plain = _policy()
    ckpt = copy.deepcopy(plain)
    checkpoint_layers(ckpt)
    tokens, mask = _batch(plain.config.vocab_size)
    weights = torch.linspace(-1, 1, tokens.shape[1])
    grads = []
    for model, packed in ((plain, False), (ckpt, True)):
        model.zero_grad(set_to_none=True)
        logp = sequence_logprobs(model, tokens, mask, packed=packed)  # type: ignore[arg-type]
        (logp * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    want, got = grads
    assert want.keys() == got.keys() and len(want) > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_packed_critic_with_a_cached_frozen_trunk() -> None:
    """SAO's cheap critic as a run trains it: its top layer alone trained, the frozen
    trunk cached across the K updates of a batch, packed rows, checkpointed layers.
    Each update's gradients are the plain padded critic's."""
    plain = ValueModel(_policy().model, None)
    freeze_below(plain, 1)
    ckpt = copy.deepcopy(plain)
    checkpoint_layers(ckpt)
    tokens, mask = _batch(plain.backbone.config.vocab_size)
    plain(tokens, mask).sum().backward()
    want = {n: p.grad.clone() for n, p in plain.named_parameters() if p.grad is not None}
    assert len(want) > 2  # the top layer's trained weights and the head
    with ckpt.trunk_cache():
        for _ in range(2):  # the first runs the trunk, the second replays it
            ckpt.zero_grad(set_to_none=True)
            ckpt(tokens, mask, packed=True).sum().backward()
            got = {n: p.grad for n, p in ckpt.named_parameters() if p.grad is not None}
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6)
