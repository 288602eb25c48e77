"""Exact, differentiable per-token log-probabilities of a causal LM: the
trainer's forward path.

Position convention (ALGORITHMS.md, notation): entry ``t`` of ``logp_BT`` is
``log p(token_t | tokens_<t)``; the first real token of each row and every
padding position get 0. This module is the one place where logits are
shifted by one.

Memory: the backbone runs once to hidden states ``[B, T, H]``; the LM head and
the log-softmax then run in chunks of ``chunk_size`` positions, each chunk
under activation checkpointing, so the ``B*T*V`` logits are never all held,
neither in the forward nor in the backward (a 150k vocabulary costs
``chunk_size * V`` floats at a time).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from sao.algo._checks import check_mask, check_ndim, check_same_shape
from sao.models.packing import run_backbone_packed

__all__ = [
    "backbone_hidden_states",
    "position_ids_from_mask",
    "run_backbone",
    "sequence_logprobs",
    "sequence_logprobs_and_entropy",
    "validate_token_batch",
]

_HEAD_VERIFIED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def validate_token_batch(tokens_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Check ``tokens_BT`` / ``attention_mask_BT`` (``[B, T]``, integer ids, a
    0/1 mask that is one contiguous block per row); return the mask as bool."""
    check_ndim("tokens_BT", tokens_BT, 2, "[B, T]")
    check_same_shape(tokens_BT=tokens_BT, attention_mask_BT=attention_mask_BT)
    if tokens_BT.is_floating_point() or tokens_BT.dtype == torch.bool:
        raise ValueError(f"tokens_BT must hold integer token ids, got dtype {tokens_BT.dtype}")
    mask_BT = check_mask("attention_mask_BT", attention_mask_BT)
    # Each row must be one contiguous run of real tokens (left or right padding).
    starts_B = mask_BT[:, :1].sum(-1) + (mask_BT[:, 1:] & ~mask_BT[:, :-1]).sum(-1)
    if bool((starts_B > 1).any()):
        row = int((starts_B > 1).nonzero()[0])
        raise ValueError(
            f"attention_mask_BT row {row} has gaps; each row must be one contiguous block of "
            "real tokens (left or right padding only)"
        )
    return mask_BT


def position_ids_from_mask(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Position ids ``[B, T]`` counting real tokens from 0, so left and right
    padding give every real token the same position; padding gets 0."""
    mask_BT = attention_mask_BT.long()
    return ((mask_BT.cumsum(-1) - 1) * mask_BT).clamp(min=0)


def run_backbone(
    backbone: nn.Module,
    tokens_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    packed: bool = False,
) -> torch.Tensor:
    """Last hidden states ``[B, T, H]`` of a base model (no LM head).

    ``backbone`` is a transformers base model (``LlamaModel``, ``GPT2Model``,
    ...); position ids come from the mask (:func:`position_ids_from_mask`).
    ``packed``: run the rows' real tokens as one padding-free sequence
    (:mod:`sao.models.packing`); the same values at real tokens.
    """
    if packed and bool(attention_mask_BT.any()):
        return run_backbone_packed(backbone, tokens_BT, attention_mask_BT.bool())
    out = backbone(
        input_ids=tokens_BT,
        attention_mask=attention_mask_BT.long(),
        position_ids=position_ids_from_mask(attention_mask_BT),
        use_cache=False,
    )
    return out.last_hidden_state


def backbone_hidden_states(
    model: PreTrainedModel, tokens_BT: torch.Tensor, attention_mask_BT: torch.Tensor
) -> torch.Tensor:
    """Final hidden states ``[B, T, H]`` of a causal LM's backbone (after the
    final norm, before the LM head)."""
    mask_BT = validate_token_batch(tokens_BT, attention_mask_BT)
    return run_backbone(model.base_model, tokens_BT, mask_BT)


def _head_logits(model: PreTrainedModel, hidden_NH: torch.Tensor) -> torch.Tensor:
    """Float32 logits ``[N, V]`` exactly as the model's forward makes them
    (LM head, then Gemma-2/3 style final-logit soft-capping when configured)."""
    head = model.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(model).__name__} has no output embeddings (LM head)")
    logits_NV = head(hidden_NH).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits_NV = torch.tanh(logits_NV / cap) * cap
    return logits_NV


def _verify_head(model: PreTrainedModel, device: torch.device) -> None:
    """Once per model object: the chunked head reproduces ``model(...).logits``.

    Guards against an architecture whose forward transforms logits in a way
    :func:`_head_logits` does not know, which would silently bias every
    importance ratio.
    """
    if model in _HEAD_VERIFIED:
        return
    vocab = int(model.get_output_embeddings().weight.shape[0])
    ids_BT = (torch.arange(3, device=device) % vocab).unsqueeze(0)
    modes = {m: m.training for m in model.modules()}
    model.eval()  # dropout off, so both paths are deterministic
    try:
        with torch.no_grad():
            ref_BTV = model(input_ids=ids_BT, use_cache=False).logits.float()
            ours_BTV = _head_logits(model, run_backbone(model.base_model, ids_BT, ids_BT >= 0))
    finally:
        for module, training in modes.items():
            module.training = training
    if not torch.isfinite(ref_BTV).all():  # diverged weights: nothing to compare (yet)
        return
    scale = max(1.0, float(ref_BTV.abs().max()))
    if not torch.allclose(ours_BTV, ref_BTV, rtol=1e-3, atol=1e-3 * scale):
        raise ValueError(
            f"sequence_logprobs does not reproduce the logits of {type(model).__name__}: its "
            "forward transforms the LM-head output in an unknown way; add that transform to "
            "sao.models.logprobs._head_logits"
        )
    _HEAD_VERIFIED.add(model)


def _chunk_stats(
    model: PreTrainedModel,
    hidden_NH: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(z / temperature)[target]`` and the entropy of that
    distribution, for one chunk of ``N`` positions."""
    logits_NV = _head_logits(model, hidden_NH) / temperature
    logz_N = torch.logsumexp(logits_NV, dim=-1)
    logp_N = logits_NV.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1) - logz_N
    if not with_entropy:
        return logp_N, torch.zeros_like(logp_N)
    # H = -sum p log p = logZ - sum p z   (p = softmax(z))
    probs_NV = torch.exp(logits_NV - logz_N.unsqueeze(-1))
    return logp_N, logz_N - (probs_NV * logits_NV).sum(-1)


def _logprobs_impl(
    model: PreTrainedModel,
    tokens_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared body of :func:`sequence_logprobs` and its entropy variant."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model)}")
    if not (isinstance(temperature, (int, float)) and 0 < temperature < float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    mask_BT = validate_token_batch(tokens_BT, attention_mask_BT)
    _verify_head(model, tokens_BT.device)
    B, T = tokens_BT.shape
    hidden_BTH = run_backbone(model.base_model, tokens_BT, mask_BT, packed=packed)
    # Token t (t >= 1) is scored by the hidden state at t - 1; both must be real.
    valid_BT = torch.zeros_like(mask_BT)
    valid_BT[:, 1:] = mask_BT[:, 1:] & mask_BT[:, :-1]
    hidden_NH = hidden_BTH[:, :-1][valid_BT[:, 1:]]
    targets_N = tokens_BT[:, 1:][valid_BT[:, 1:]].long()
    use_ckpt = torch.is_grad_enabled()
    logp_parts, ent_parts = [], []
    for s in range(0, targets_N.shape[0], chunk_size):
        args = (model, hidden_NH[s : s + chunk_size], targets_N[s : s + chunk_size])
        if use_ckpt:
            lp_N, ent_N = checkpoint(
                _chunk_stats, *args, temperature, with_entropy, use_reentrant=False
            )
        else:
            lp_N, ent_N = _chunk_stats(*args, temperature, with_entropy)
        logp_parts.append(lp_N)
        ent_parts.append(ent_N)
    flat_idx_N = valid_BT.reshape(-1).nonzero().squeeze(-1)
    zeros = hidden_BTH.new_zeros(B * T, dtype=torch.float32)
    if not logp_parts:
        return zeros.view(B, T), zeros.view(B, T).clone()
    logp_BT = zeros.index_put((flat_idx_N,), torch.cat(logp_parts)).view(B, T)
    entropy_BT = zeros.index_put((flat_idx_N,), torch.cat(ent_parts)).view(B, T)
    return logp_BT, entropy_BT


def sequence_logprobs(
    model: PreTrainedModel,
    tokens_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    packed: bool = False,
) -> torch.Tensor:
    """Per-token log-probabilities ``logp_BT`` (float32 ``[B, T]``) of ``tokens_BT``.

    ``logp_BT[b, t] = log softmax(z_{b,t-1} / temperature)[tokens_BT[b, t]]``
    where ``z_{b,t-1}`` are the logits after token ``t - 1``; 0 for the first
    real token of a row and for padding. Dividing by the sampling
    temperature reproduces the distribution the engine sampled from
    (ALGORITHMS.md section 6). Differentiable; the LM head runs in chunks of
    ``chunk_size`` positions under activation checkpointing. ``packed``: the
    backbone runs padding-free (:mod:`sao.models.packing`), same result.
    """
    logp_BT, _ = _logprobs_impl(
        model, tokens_BT, attention_mask_BT, temperature, chunk_size, False, packed
    )
    return logp_BT


def sequence_logprobs_and_entropy(
    model: PreTrainedModel,
    tokens_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequence_logprobs` plus ``entropy_BT``: the entropy (nats) of the
    temperature-scaled next-token distribution that token ``t`` was drawn
    from, ``H = -sum_v p_v log p_v``; 0 where ``logp_BT`` is 0."""
    return _logprobs_impl(
        model, tokens_BT, attention_mask_BT, temperature, chunk_size, with_entropy=True
    )
