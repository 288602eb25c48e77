"""One Llama-family decoder layer as two pure functions of tensors.

:func:`pre_attention` (input norm, fused q/k/v projection, optional q/k norms,
rotary embedding) and :func:`post_attention` (output projection, residual,
post-attention norm, fused gate/up projection, SiLU gate, down projection,
residual) take a layer's weights as arguments, so one compiled graph serves
every layer and every weight version. Attention over the KV cache stays
between them, in eager mode, where the cache is written in place.

:class:`Kernels` runs them eagerly, or compiled with ``torch.compile``
(inductor fuses the norms, rotary and elementwise work that eager mode
dispatches one operator at a time). Shapes are dynamic (batch and length
vary every step), so a model compiles once per process; inductor's on-disk
cache makes later processes cheaper. A compile that fails falls back to eager
with one logged line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``; one bfloat16 row goes through ``torch.mv``, which streams
    the weight ~1.7x faster than ``F.linear`` on the CPU (measured at batch 1)."""
    if x.dtype == torch.bfloat16 and x.numel() == x.shape[-1] and not x.is_cuda:
        out = torch.mv(weight, x.reshape(-1)).view(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face ``LlamaRMSNorm``: normalise in float32, scale in the input dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x_NHTD: torch.Tensor, cos_NTD: torch.Tensor, sin_NTD: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021, RoFormer, eq. 34), HF's rotate-half layout."""
    cos, sin = cos_NTD.unsqueeze(1), sin_NTD.unsqueeze(1)
    return x_NHTD * cos + rotate_half(x_NHTD) * sin


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
    h_NTC: torch.Tensor,
    cos_NTD: torch.Tensor,
    sin_NTD: torch.Tensor,
    ln1: torch.Tensor,
    qkv_w: torch.Tensor,
    qkv_b: torch.Tensor | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    qk_eps: float,
    heads: tuple[int, int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normed, projected and rotated ``q [N,H,T,D]`` and ``k, v [N,K,T,D]``;
    ``heads`` = (H, K, D)."""
    H, K, D = heads
    N, T, _ = h_NTC.shape
    qkv = linear(rms_norm(h_NTC, ln1, eps), qkv_w, qkv_b)
    q, k, v = qkv.split([H * D, K * D, K * D], dim=-1)
    q, k, v = q.view(N, T, H, D), k.view(N, T, K, D), v.view(N, T, K, D)
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm(q, q_norm, qk_eps), rms_norm(k, k_norm, qk_eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return apply_rope(q, cos_NTD, sin_NTD), apply_rope(k, cos_NTD, sin_NTD), v


def post_attention(
    h_NTC: torch.Tensor,
    attn_NTC: torch.Tensor,
    o_w: torch.Tensor,
    o_b: torch.Tensor | None,
    ln2: torch.Tensor,
    gate_up_w: torch.Tensor,
    gate_up_b: torch.Tensor | None,
    down_w: torch.Tensor,
    down_b: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """The residual stream after the attention output and the gated MLP."""
    h_NTC = h_NTC + linear(attn_NTC, o_w, o_b)
    gate, up = linear(rms_norm(h_NTC, ln2, eps), gate_up_w, gate_up_b).chunk(2, dim=-1)
    return h_NTC + linear(F.silu(gate) * up, down_w, down_b)


class Kernels:
    """:func:`pre_attention` and :func:`post_attention`, eager or compiled.

    ``compile=True`` compiles them with dynamic shapes. Torch still compiles a
    separate graph for a batch of 1 and for a length of 1 (it specialises sizes
    0 and 1), so each kernel compiles at most four times per process: the
    first call of each kind is timed and logged. When compiling or running the
    compiled code raises, the kernels fall back to eager for good, with one
    logged line.
    """

    def __init__(self, heads: tuple[int, int, int], *, compile: bool = False) -> None:
        self.heads = heads
        self.compiled = compile
        self.compile_s = 0.0  # total seconds of the first calls, which compile
        self._seen: set[tuple[str, bool, bool]] = set()
        self._pre: Callable[..., Any] = pre_attention
        self._post: Callable[..., Any] = post_attention
        if compile:
            # 4 graphs per dtype and per architecture variant (q/k norms, biases):
            # torch's default of 8 per function would send a second model to eager
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._pre = torch.compile(pre_attention, dynamic=True)
            self._post = torch.compile(post_attention, dynamic=True)

    def pre(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: LayerWeights
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        args = (h, cos, sin, w.ln1, w.qkv_w, w.qkv_b, w.q_norm, w.k_norm, w.eps, w.qk_eps)
        return self._call(self._pre, pre_attention, *args, self.heads)

    def post(self, h: torch.Tensor, attn: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        args = (w.o_w, w.o_b, w.ln2, w.gate_up_w, w.gate_up_b, w.down_w, w.down_b, w.eps)
        return self._call(self._post, post_attention, h, attn, *args)

    def _call(self, fn: Callable[..., Any], eager: Callable[..., Any], *args: Any) -> Any:
        if not self.compiled:
            return eager(*args)
        N, T = args[0].shape[:2]
        kind = (eager.__name__, N == 1, T == 1)
        start = time.perf_counter()
        try:
            out = fn(*args)
        except Exception as exc:  # any compiler failure means eager
            log.warning("embedded engine: torch.compile failed (%r); decoding eagerly", exc)
            self.compiled = False
            return eager(*args)
        if kind not in self._seen:
            self._seen.add(kind)
            seconds = time.perf_counter() - start
            self.compile_s += seconds
            log.info(
                "embedded engine: compiled %s (batch %s, length %s) in %.1f s",
                eager.__name__,
                "1" if N == 1 else "> 1",
                "1" if T == 1 else "> 1",
                seconds,
            )
        return out


def layer_weights(
    layers: Sequence[Any], fuse: Callable[[Sequence[Any]], Any]
) -> list[LayerWeights]:
    """Each HF decoder layer's :class:`LayerWeights`, its q/k/v and gate/up
    linears fused by ``fuse`` (which makes their weights views of the fused ones)."""
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
