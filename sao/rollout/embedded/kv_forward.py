"""Cached forward passes for the embedded engine.

:class:`StaticKVForward` is a compact decoder forward for the Llama family
(Llama, Qwen2, Qwen3 with q/k norm, Mistral) over a preallocated KV cache of
static slots, ``k_cache``/``v_cache`` of shape ``[layers, slots, kv_heads,
max_seq_len, head_dim]``. It reuses the Hugging Face model's own modules and
weights (embeddings, norms, projections, MLPs, rotary embedding, lm head), so an
in-place weight copy into the model is all a weight update needs.

:class:`DynamicCacheForward` is the fallback for every other causal LM: the
model's own forward with one ``DynamicCache`` per request, one request at a
time. It is correct for any architecture the model's forward is correct for,
but does not batch the decode step, so it is much slower, and it does not
reuse cached prefixes.

Both expose the same calls: ``prefill`` (write a slot's cache from a sequence
fed at positions ``start..start+len-1`` on top of the ``start`` positions the
slot already holds, return the logits at its last position), ``decode`` (feed
one token per slot at its position, return the next-token logits), ``release``,
and the slot moves the scheduler's compaction and prefix reuse need: ``move``,
``copy``, ``swap``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from sao.rollout.embedded.layers import (
    Rotary,
    fusable,
    layer_weights,
    linear,
    post_attention,
    pre_attention,
)

STATIC_KV_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

# ``kv_io(layer, k, v)`` stores a layer's new keys and values, returns those to attend over.
KVIO = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# Boolean attention masks ``[N, 1, R*Tq, Tk]`` by sliding-window size (None = full).
Masks = dict[int | None, torch.Tensor]


class CachedForward(Protocol):
    """What the engine needs from a cached forward pass."""

    def prefill(
        self,
        slots: Sequence[int],
        seqs: Sequence[Sequence[int]],
        starts: Sequence[int] | None = None,
    ) -> torch.Tensor: ...

    def decode(
        self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]
    ) -> torch.Tensor: ...

    def release(self, slot: int) -> None: ...

    def move(self, src: int, dst: int, length: int) -> None: ...

    def copy(self, src: int, dst: int, length: int) -> None: ...

    def swap(self, a: int, b: int, length: int) -> None: ...

    def close(self) -> None: ...


def supports_static_kv(model: nn.Module) -> bool:
    """True when ``model`` is a Llama-family decoder :class:`StaticKVForward` can run."""
    config = getattr(model, "config", None)
    backbone = getattr(model, "model", None)
    if getattr(config, "model_type", None) not in STATIC_KV_MODEL_TYPES or backbone is None:
        return False
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if not all(hasattr(backbone, name) for name in needed) or not hasattr(model, "lm_head"):
        return False
    if getattr(config, "hidden_act", "silu") != "silu":
        return False
    for layer in backbone.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")):
            return False
        if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
            return False
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if not all(hasattr(n, "variance_epsilon") and hasattr(n, "weight") for n in norms):
            return False
        if norms[0].variance_epsilon != norms[1].variance_epsilon:
            return False
        if not fusable([attn.q_proj, attn.k_proj, attn.v_proj]):
            return False
        if not fusable([mlp.gate_proj, mlp.up_proj]):
            return False
    return True


def _layer_windows(model: nn.Module) -> list[int | None]:
    """Sliding-window size of each layer (None = full causal attention)."""
    config = cast(Any, model).config
    layers = cast(Any, model).model.layers
    layer_types = getattr(config, "layer_types", None)
    windows: list[int | None] = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        if hasattr(attn, "sliding_window"):
            windows.append(attn.sliding_window)
        elif layer_types is not None:
            sliding = layer_types[i] == "sliding_attention"
            windows.append(config.sliding_window if sliding else None)
        else:
            windows.append(getattr(config, "sliding_window", None))
    return windows


class StaticKVForward:
    """Batched cached forward for Llama-family decoders over static KV slots.

    Shapes: N rows in a call, T positions, H query heads, K kv heads, D head
    dim, C hidden size, S = ``max_seq_len``. Grouped-query attention runs
    without copying keys: the H = K * R query heads are folded into the query
    axis (``[N, K, R*T, D]``) against ``[N, K, S, D]`` keys, which is the same
    arithmetic as repeating each kv head R times.

    Each layer runs as :func:`~sao.rollout.embedded.layers.pre_attention`,
    attention over the cache, and :func:`~sao.rollout.embedded.layers.post_attention`.
    """

    def __init__(self, model: nn.Module, *, max_batch_size: int, max_seq_len: int) -> None:
        if not supports_static_kv(model):
            raise ValueError(
                f"StaticKVForward supports model types {STATIC_KV_MODEL_TYPES}, got "
                f"{getattr(model.config, 'model_type', None)!r}; use DynamicCacheForward"
            )
        # HF modules are reached by attribute name; typed Any for that reason.
        self.model = cast(Any, model)
        self.backbone = self.model.model
        attn = self.backbone.layers[0].self_attn
        config = self.model.config
        self.head_dim = int(attn.head_dim)
        self.n_heads = int(config.num_attention_heads)
        self.n_kv = int(getattr(config, "num_key_value_heads", None) or self.n_heads)
        self.rep = self.n_heads // self.n_kv
        self.scale = float(getattr(attn, "scaling", self.head_dim**-0.5))
        self.windows = _layer_windows(model)
        self.max_seq_len = max_seq_len
        weight = self.backbone.embed_tokens.weight
        shape = (len(self.backbone.layers), max_batch_size, self.n_kv, max_seq_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.v_cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        # q/k/v and gate/up projections as one matmul each (the modules' weights
        # become views of the fused ones: weight updates copied into them land there)
        self.weights = layer_weights(self.backbone.layers)
        self.heads = (self.n_heads, self.n_kv, self.head_dim)

    @property
    def device(self) -> torch.device:
        return self.k_cache.device

    def _attend(
        self,
        q_NHTD: torch.Tensor,
        k_NKSD: torch.Tensor,
        v_NKSD: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Masked attention with kv heads shared by R query heads; ``mask`` is
        :meth:`_masks`' (its query axis already repeated R times). Returns ``[N, T, H*D]``."""
        N, H, T, D = q_NHTD.shape
        q = q_NHTD.reshape(N, self.n_kv, self.rep * T, D)
        out = F.scaled_dot_product_attention(q, k_NKSD, v_NKSD, attn_mask=mask, scale=self.scale)
        return out.view(N, H, T, D).transpose(1, 2).reshape(N, T, H * D)

    def _layers(
        self,
        h_NTC: torch.Tensor,
        pos_NT: torch.Tensor,
        kv_io: KVIO,
        masks: Masks,
    ) -> torch.Tensor:
        """Run every decoder layer; ``kv_io(i, k, v)`` stores the new keys and
        returns those to attend over. Returns the final-normed hidden states."""
        rope = Rotary.of(*self.backbone.rotary_emb(h_NTC, pos_NT))
        for i, w in enumerate(self.weights):
            q, k, v = pre_attention(h_NTC, rope, w, self.heads)
            k_all, v_all = kv_io(i, k, v)
            attn_out = self._attend(q, k_all, v_all, masks[self.windows[i]])
            h_NTC = post_attention(h_NTC, attn_out, w)
        return self.backbone.norm(h_NTC)

    def _masks(self, q_pos: torch.Tensor, k_pos: torch.Tensor, valid: torch.Tensor) -> Masks:
        """Boolean masks per window size: causal, valid keys, and ``q - k <
        window`` (HF ``sliding_window_overlay``), ``[N, 1, R*Tq, Tk]`` with the
        query axis repeated for the R query heads of a kv head (see :meth:`_attend`)."""
        base = (k_pos <= q_pos) & valid
        masks: Masks = {}
        for w in set(self.windows):
            m = base if w is None else base & (k_pos > q_pos - w)  # [N, Tq, Tk]
            N, Tq, Tk = m.shape
            masks[w] = m.unsqueeze(1).expand(N, self.rep, Tq, Tk).reshape(N, 1, self.rep * Tq, Tk)
        return masks

    @torch.no_grad()
    def prefill(
        self,
        slots: Sequence[int],
        seqs: Sequence[Sequence[int]],
        starts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Write slot ``slots[n]``'s cache at positions ``starts[n] ..
        starts[n] + len(seqs[n]) - 1`` from ``seqs[n]`` (``starts=None``: all 0).

        Positions below ``starts[n]`` must already hold the keys and values of
        the sequence's first ``starts[n]`` tokens (a reused prefix): the new
        tokens attend to those and, causally, to each other, which is the same
        arithmetic as prefilling the whole sequence. Rows with different
        offsets prefill together. Returns ``logits_NV`` at each sequence's last
        position (model dtype).
        """
        dev = self.device
        lens = [len(s) for s in seqs]
        N, T = len(seqs), max(lens)
        ids_NT = torch.zeros((N, T), dtype=torch.long)
        for n, s in enumerate(seqs):
            ids_NT[n, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        ids_NT = ids_NT.to(dev)
        len_N = torch.tensor(lens, device=dev)
        slot_N = torch.tensor(list(slots), device=dev)
        if starts is not None and any(starts):
            pos_NT, masks, kv_io = self._offset_io(slot_N, torch.tensor(list(starts)), len_N, T)
        else:
            pos_NT, masks, kv_io = self._fresh_io(slot_N, len_N, T)
        h_NTC = self._layers(self.backbone.embed_tokens(ids_NT), pos_NT, kv_io, masks)
        last_NC = h_NTC[torch.arange(N, device=dev), len_N - 1]
        return self.model.lm_head(last_NC)

    def _fresh_io(
        self, slot_N: torch.Tensor, len_N: torch.Tensor, T: int
    ) -> tuple[torch.Tensor, Masks, KVIO]:
        """Positions, masks and cache writer of a prefill from position 0: the
        tokens attend to their own keys, the cache is only written."""
        dev, N = self.device, len(slot_N)
        pos_T = torch.arange(T, device=dev)
        masks = self._masks(
            pos_T.view(1, T, 1), pos_T.view(1, 1, T), pos_T.view(1, 1, T) < len_N.view(N, 1, 1)
        )

        def kv_io(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.k_cache[i, slot_N, :, :T] = k
            self.v_cache[i, slot_N, :, :T] = v
            return k, v

        return pos_T.expand(N, T), masks, kv_io

    def _offset_io(
        self, slot_N: torch.Tensor, start_N: torch.Tensor, len_N: torch.Tensor, T: int
    ) -> tuple[torch.Tensor, Masks, KVIO]:
        """Positions, masks and cache reader/writer of a prefill on top of a
        cached prefix: row n's token t sits at position ``start_N[n] + t``; only
        real (unpadded) tokens are written, and every row attends over its
        slot's cache ``[0, L)``, L the longest ``start + len``."""
        dev, N = self.device, len(slot_N)
        start_N = start_N.to(dev)
        pos_NT = start_N.view(N, 1) + torch.arange(T, device=dev)
        end_N = start_N + len_N
        L = int(end_N.max())
        n_M, t_M = (torch.arange(T, device=dev) < len_N.view(N, 1)).nonzero(as_tuple=True)
        slot_M, p_M = slot_N[n_M], pos_NT[n_M, t_M]
        k_pos = torch.arange(L, device=dev).view(1, 1, L)
        masks = self._masks(pos_NT.view(N, T, 1), k_pos, k_pos < end_N.view(N, 1, 1))

        def kv_io(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k_cache, v_cache = self.k_cache[i], self.v_cache[i]  # [slots, K, S, D] views
            k_cache[slot_M, :, p_M] = k.transpose(1, 2)[n_M, t_M]  # [M, K, D]
            v_cache[slot_M, :, p_M] = v.transpose(1, 2)[n_M, t_M]
            return k_cache[slot_N, :, :L], v_cache[slot_N, :, :L]

        return pos_NT, masks, kv_io

    @torch.no_grad()
    def decode(
        self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]
    ) -> torch.Tensor:
        """Feed ``tokens[n]`` at ``positions[n]`` of slot ``slots[n]``; returns
        next-token ``logits_NV`` in the order of ``slots``.

        Runs over the contiguous slot range ``[0, max(slots)]`` so the cache is
        read as a view, never gathered; free slots in that range compute on a
        dummy token at position 0 and are discarded.
        """
        dev = self.device
        hi = max(slots) + 1
        ids = [0] * hi
        pos = [0] * hi
        for s, t, p in zip(slots, tokens, positions, strict=True):
            ids[s], pos[s] = t, p
        L = max(positions) + 1
        ids_B1 = torch.tensor(ids, device=dev).view(hi, 1)
        pos_B1 = torch.tensor(pos, device=dev).view(hi, 1)
        k_pos = torch.arange(L, device=dev).view(1, 1, L)
        masks = self._masks(
            pos_B1.view(hi, 1, 1), k_pos, torch.ones((), dtype=torch.bool, device=dev)
        )
        rows, pos_B = torch.arange(hi, device=dev), pos_B1.view(hi)
        k_rows, v_rows = self.k_cache[:, :hi, :, :L], self.v_cache[:, :hi, :, :L]

        def kv_io(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k_view, v_view = k_rows[i], v_rows[i]  # [hi, K, L, D] views of the cache
            k_view[rows, :, pos_B] = k[:, :, 0]  # (index_put_: scatter_ copies in bfloat16)
            v_view[rows, :, pos_B] = v[:, :, 0]
            return k_view, v_view

        h_B1C = self._layers(self.backbone.embed_tokens(ids_B1), pos_B1, kv_io, masks)
        head = self.model.lm_head
        logits_BV = linear(h_B1C[:, 0], head.weight, head.bias)
        if len(slots) == hi and list(slots) == list(range(hi)):
            return logits_BV
        return logits_BV[torch.tensor(list(slots), device=dev)]

    def release(self, slot: int) -> None:
        """Nothing to free: a slot's stale entries are masked by position."""

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` cached positions of slot ``src`` into ``dst``."""
        self.k_cache[:, dst, :, :length] = self.k_cache[:, src, :, :length]
        self.v_cache[:, dst, :, :length] = self.v_cache[:, src, :, :length]

    def copy(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of ``src`` into ``dst``; ``src`` keeps them."""
        self.move(src, dst, length)

    def swap(self, a: int, b: int, length: int) -> None:
        """Exchange the first ``length`` cached positions of slots ``a`` and ``b``
        (one layer at a time, so the temporary copy is two rows of one layer)."""
        ab = torch.tensor([a, b], device=self.device)
        ba = torch.tensor([b, a], device=self.device)
        for cache in (*self.k_cache, *self.v_cache):
            cache[ab, :, :length] = cache[ba, :, :length]

    def close(self) -> None:
        """Free the cache memory; the object cannot run afterwards."""
        self.k_cache = self.v_cache = torch.empty(0)


class DynamicCacheForward:
    """Fallback for any causal LM: the model's own forward with one HF
    ``DynamicCache`` per slot, one request at a time (correct, not batched)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = cast(Any, model)
        self.device = next(model.parameters()).device
        self._caches: dict[int, object] = {}
        # transformers 5 renamed ``past_key_values`` to ``cache``.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @torch.no_grad()
    def prefill(
        self,
        slots: Sequence[int],
        seqs: Sequence[Sequence[int]],
        starts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Run each sequence from scratch; returns ``logits_NV`` at its last
        position. No prefix reuse (``starts`` must be 0): cropping a cache is
        not supported by every cache class and transformers version."""
        if starts is not None and any(starts):
            raise NotImplementedError("DynamicCacheForward does not reuse cached prefixes")
        rows = []
        for slot, seq in zip(slots, seqs, strict=True):
            ids = torch.as_tensor([list(seq)], dtype=torch.long, device=self.device)
            out = self.model(input_ids=ids, use_cache=True)
            self._caches[slot] = out[self._cache_kw]
            rows.append(out.logits[0, -1])
        return torch.stack(rows)

    @torch.no_grad()
    def decode(
        self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]
    ) -> torch.Tensor:
        """Feed one token per slot on top of its cache; returns ``logits_NV``."""
        rows = []
        for slot, token in zip(slots, tokens, strict=True):
            ids = torch.tensor([[token]], dtype=torch.long, device=self.device)
            kwargs = {self._cache_kw: self._caches[slot]}
            out = self.model(input_ids=ids, use_cache=True, **kwargs)
            self._caches[slot] = out[self._cache_kw]
            rows.append(out.logits[0, -1])
        return torch.stack(rows)

    def release(self, slot: int) -> None:
        """Drop the slot's cache."""
        self._caches.pop(slot, None)

    def move(self, src: int, dst: int, length: int) -> None:
        """Hand slot ``src``'s cache to ``dst``."""
        self._caches[dst] = self._caches.pop(src)

    def copy(self, src: int, dst: int, length: int) -> None:
        """Not supported: this forward does not reuse cached prefixes."""
        raise NotImplementedError("DynamicCacheForward does not reuse cached prefixes")

    def swap(self, a: int, b: int, length: int) -> None:
        """Exchange the caches of slots ``a`` and ``b``."""
        cache_a, cache_b = self._caches.pop(a, None), self._caches.pop(b, None)
        if cache_a is not None:
            self._caches[b] = cache_a
        if cache_b is not None:
            self._caches[a] = cache_b

    def close(self) -> None:
        """Drop every cache."""
        self._caches.clear()
