"""One Llama-family decoder layer as two functions of tensors.

:func:`pre_attention` (input norm, fused q/k/v projection, optional q/k norms,
rotary embedding) and :func:`post_attention` (output projection, residual,
post-attention norm, fused gate/up projection, SiLU gate, down projection,
residual) take a layer's weights (:class:`LayerWeights`, views of the model's
parameters, so in-place weight updates reach them). Attention over the KV
cache runs between them (``StaticKVForward``).

At batch 1 on the CPU a decode step is bound by streaming the weights plus
Python's cost per operator, so the functions keep the operator count low:
one ``rms_norm`` call per norm, the rotary embedding as two multiplies and a
roll over q and k together (:class:`Rotary`). Compiling them with
``torch.compile`` was measured slower (BENCHMARKS.md): its per-call overhead
outweighed the fusion at both batch sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``; one bfloat16 row goes through ``torch.mv``, which streamed
    the weight faster than ``F.linear`` on the reference CPU at batch 1."""
    if x.dtype == torch.bfloat16 and x.numel() == x.shape[-1] and not x.is_cuda:
        out = torch.mv(weight, x.reshape(-1)).view(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face ``LlamaRMSNorm``: normalise in float32, scale in the input
    dtype (float32 input: torch's ``rms_norm``, the same values in one call)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@dataclass(frozen=True)
class Rotary:
    """One step's rotary tables (Su et al. 2021, RoFormer, eq. 34), HF's
    rotate-half layout, shaped ``[N, T, 1, D]`` to broadcast over heads:
    ``x * cos + roll(x, D/2) * sin_signed`` is HF's ``x * cos + rotate_half(x) * sin``,
    since ``roll`` gives ``[x2, x1]`` and ``sin_signed`` is ``[-sin1, sin2]``."""

    cos: torch.Tensor
    sin_signed: torch.Tensor

    @classmethod
    def of(cls, cos_NTD: torch.Tensor, sin_NTD: torch.Tensor) -> Rotary:
        half = sin_NTD.shape[-1] // 2
        signed = torch.cat((-sin_NTD[..., :half], sin_NTD[..., half:]), dim=-1)
        return cls(cos_NTD.unsqueeze(2), signed.unsqueeze(2))

    def __call__(self, x_NTHD: torch.Tensor) -> torch.Tensor:
        return x_NTHD * self.cos + x_NTHD.roll(x_NTHD.shape[-1] // 2, -1) * self.sin_signed


@dataclass(frozen=True)
class LayerWeights:
    """A decoder layer's tensors (views of the model's parameters, so in-place
    weight updates reach them) and its norms' epsilons."""

    ln1: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    ln2: torch.Tensor
    gate_up_w: torch.Tensor
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None
    eps: float
    qk_eps: float


def pre_attention(
    h_NTC: torch.Tensor, rope: Rotary, w: LayerWeights, heads: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normed, projected and rotated ``q [N,H,T,D]`` and ``k, v [N,K,T,D]``;
    ``heads`` = (H, K, D)."""
    H, K, D = heads
    N, T, _ = h_NTC.shape
    qkv = linear(rms_norm(h_NTC, w.ln1, w.eps), w.qkv_w, w.qkv_b).view(N, T, H + 2 * K, D)
    if w.q_norm is not None and w.k_norm is not None:
        q = rope(rms_norm(qkv[:, :, :H], w.q_norm, w.qk_eps))
        k = rope(rms_norm(qkv[:, :, H : H + K], w.k_norm, w.qk_eps))
    else:  # q and k rotated together
        q, k = rope(qkv[:, :, : H + K]).split([H, K], dim=2)
    v = qkv[:, :, H + K :]
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def post_attention(h_NTC: torch.Tensor, attn_NTC: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    """The residual stream after the attention output and the gated MLP."""
    h_NTC = h_NTC + linear(attn_NTC, w.o_w, w.o_b)
    x = rms_norm(h_NTC, w.ln2, w.eps)
    gate, up = linear(x, w.gate_up_w, w.gate_up_b).chunk(2, dim=-1)
    return h_NTC + linear(F.silu(gate) * up, w.down_w, w.down_b)


def fusable(mods: Sequence[Any]) -> bool:
    """True when the linears ``mods`` share their input size and all have, or all lack, a bias."""
    return len({m.weight.shape[1] for m in mods}) == 1 and len({m.bias is None for m in mods}) == 1


def fuse(mods: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight ``[sum of outs, in]`` (and bias) holding the linears ``mods``
    (see :func:`fusable`), whose own weights become views of it, so that an
    in-place weight update of any of them lands in the fused copy."""
    w = torch.cat([m.weight.data for m in mods])
    b = None if mods[0].bias is None else torch.cat([m.bias.data for m in mods])
    at = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight.data = w[at : at + n]
        if b is not None:
            m.bias.data = b[at : at + n]
        at += n
    return w, b


def layer_weights(layers: Sequence[Any]) -> list[LayerWeights]:
    """Each HF decoder layer's :class:`LayerWeights`, its q/k/v and gate/up
    linears fused (:func:`fuse`: their weights become views of the fused ones)."""
    out = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_w, qkv_b = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        gu_w, gu_b = fuse([mlp.gate_proj, mlp.up_proj])
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        out.append(
            LayerWeights(
                ln1=layer.input_layernorm.weight,
                qkv_w=qkv_w,
                qkv_b=qkv_b,
                q_norm=None if q_norm is None else q_norm.weight,
                k_norm=None if k_norm is None else k_norm.weight,
                o_w=attn.o_proj.weight,
                o_b=attn.o_proj.bias,
                ln2=layer.post_attention_layernorm.weight,
                gate_up_w=gu_w,
                gate_up_b=gu_b,
                down_w=mlp.down_proj.weight,
                down_b=mlp.down_proj.bias,
                eps=float(layer.input_layernorm.variance_epsilon),
                qk_eps=float(q_norm.variance_epsilon) if q_norm is not None else 0.0,
            )
        )
    return out
