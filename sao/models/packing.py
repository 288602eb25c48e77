"""Padding-free forward: the real tokens of a micro-batch's rows run as one
packed sequence ``[1, N]`` (``N`` = their total length), never a padded ``[B, T]``.

How rows stay apart: position ids restart at 0 for every row and the
backbone gets ``attention_mask=None``. That is transformers' own packed format
(``masking_utils.find_packed_sequence_indices``: a new row starts wherever the
position does not grow by one). From it transformers builds, per attention
implementation, a block-diagonal causal mask (eager: float additive; SDPA: bool)
or, with flash-attention, its variable-length kernel (``cu_seqlens``). So one
code path is exact on the CPU (SDPA/eager) and padding-free on a GPU. A row of
one token starts at 0 after any row, so it is always its own block.

Attention on the CPU: SDPA and eager get the rows' boundaries as a dense
``[N, N]`` block-diagonal mask, so attention costs ``N^2`` instead of
``sum(len^2)``. While a packed forward runs, an ``sdpa`` or ``eager`` model
uses :func:`varlen_attention` instead (registered with transformers as
``"sao_varlen"``): causal SDPA on each row's slice of the packed sequence,
rows found where the position ids restart, no mask built. Flash-attention
models keep their own variable-length kernel.

Guard: the first time a model object runs packed, :func:`verify_packing`
compares a packed and a padded forward of two short rows; an architecture that
ignores position ids for masking (so rows would attend across each other)
raises instead of silently mixing rows.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

__all__ = [
    "VARLEN",
    "PackedRows",
    "pack_rows",
    "run_backbone_packed",
    "varlen_attention",
    "verify_packing",
]

VARLEN = "sao_varlen"
"""The attention implementation a packed forward of an SDPA/eager model runs."""
_DENSE = ("sdpa", "eager")

_PACKING_VERIFIED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@dataclass(frozen=True)
class PackedRows:
    """The real tokens of ``[B, T]`` rows as one sequence.

    ``tokens_1N`` / ``position_ids_1N``: ``[1, N]``; ``flat_index_N``: where
    each packed token sits in the flattened ``[B * T]`` padded layout.
    """

    tokens_1N: torch.Tensor
    position_ids_1N: torch.Tensor
    flat_index_N: torch.Tensor


def pack_rows(tokens_BT: torch.Tensor, mask_BT: torch.Tensor) -> PackedRows:
    """Pack the real tokens (``mask_BT`` True; left or right padding) of each
    row, in row order, with position ids counting from 0 within each row."""
    mask = mask_BT.bool()
    pos_BT = (mask.long().cumsum(-1) - 1).clamp(min=0)
    flat = mask.reshape(-1)
    return PackedRows(
        tokens_1N=tokens_BT.reshape(-1)[flat].unsqueeze(0),
        position_ids_1N=pos_BT.reshape(-1)[flat].unsqueeze(0),
        flat_index_N=flat.nonzero().squeeze(-1),
    )


def varlen_attention(
    module: nn.Module,
    query_1HND: torch.Tensor,
    key_1HND: torch.Tensor,
    value_1HND: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention over a packed ``[1, N]`` sequence, row by row: causal SDPA on
    each row's slice (rows start where ``position_ids`` is 0), rows of equal
    length stacked into one call, so the work is ``sum(len^2) / 2`` score
    pairs, not the dense ``N^2``. Returns ``[1, N, H, D]`` as transformers'
    attention functions do."""
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or not isinstance(position_ids, torch.Tensor):
        raise ValueError(f"{VARLEN} attention runs packed rows only (no mask, position ids)")
    N = query_1HND.shape[2]
    starts = (position_ids.reshape(-1)[:N] == 0).nonzero().reshape(-1).tolist()
    bounds = [*starts, N] if starts and starts[0] == 0 else [0, *starts, N]
    by_len: dict[int, list[int]] = {}
    for s, e in itertools.pairwise(bounds):
        by_len.setdefault(e - s, []).append(s)
    # one gather puts rows of equal length side by side ([H, rows * n, D] per length),
    # one more puts the outputs back (slicing each row would cost a full-size
    # gradient buffer per row in the backward)
    dev = query_1HND.device
    order = [s + t for n, group in by_len.items() for s in group for t in range(n)]
    order_N = torch.tensor(order, dtype=torch.long, device=dev)
    inverse_N = torch.empty_like(order_N)
    inverse_N[order_N] = torch.arange(N, device=dev)
    q, k, v = (x[0].index_select(1, order_N) for x in (query_1HND, key_1HND, value_1HND))
    outs, at = [], 0
    for n, group in by_len.items():
        span = slice(at, at + n * len(group))
        at = span.stop

        def rows(x_HND: torch.Tensor, span: slice = span, n: int = n) -> torch.Tensor:
            H, _, D = x_HND.shape
            return x_HND[:, span].reshape(H, -1, n, D).transpose(0, 1)  # [rows, H, n, D]

        args = (module, rows(q), rows(k), rows(v), None)
        out = sdpa_attention_forward(*args, dropout=dropout, scaling=scaling, is_causal=True)
        out_RNHD = out[0]
        outs.append(out_RNHD.reshape(-1, *out_RNHD.shape[2:]))  # [rows * n, H, D]
    return torch.cat(outs).index_select(0, inverse_N).unsqueeze(0), None


AttentionInterface.register(VARLEN, varlen_attention)


@contextmanager
def _varlen(backbone: nn.Module) -> Iterator[None]:
    """While it is open, an SDPA/eager ``backbone`` attends with :data:`VARLEN`."""
    config = getattr(backbone, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if config is None or impl not in _DENSE:
        yield
        return
    config._attn_implementation = VARLEN
    try:
        yield
    finally:
        config._attn_implementation = impl


def _packed_hidden(
    backbone: nn.Module, tokens_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """Hidden states ``[B, T, H]`` from one packed forward; 0 at padding."""
    B, T = tokens_BT.shape
    packed = pack_rows(tokens_BT, mask_BT)
    with _varlen(backbone):
        out = backbone(
            input_ids=packed.tokens_1N,
            attention_mask=None,  # rows are told apart by their restarting position ids
            position_ids=packed.position_ids_1N,
            use_cache=False,
        )
    hidden_NH = out.last_hidden_state[0]
    zeros = hidden_NH.new_zeros(B * T, hidden_NH.shape[-1])
    return zeros.index_put((packed.flat_index_N,), hidden_NH).view(B, T, -1)


def verify_packing(backbone: nn.Module, device: torch.device) -> None:
    """Once per model object: a packed forward of rows of 3 and 2 tokens
    reproduces the padded one (so rows cannot see each other)."""
    if backbone in _PACKING_VERIFIED:
        return
    config = getattr(backbone, "config", None)
    vocab = int(getattr(config, "vocab_size", 2) or 2)
    ids_BT = (torch.tensor([[1, 2, 3], [4, 5, 0]], device=device) % vocab).long()
    mask_BT = torch.tensor([[True, True, True], [True, True, False]], device=device)
    modes = {m: m.training for m in backbone.modules()}
    backbone.eval()  # dropout off, so both paths are deterministic
    try:
        with torch.no_grad():
            padded = backbone(
                input_ids=ids_BT,
                attention_mask=mask_BT.long(),
                position_ids=(mask_BT.long().cumsum(-1) - 1).clamp(min=0),
                use_cache=False,
            ).last_hidden_state.float()
            packed = _packed_hidden(backbone, ids_BT, mask_BT).float()
    finally:
        for module, training in modes.items():
            module.training = training
    if not torch.isfinite(padded[mask_BT]).all():  # diverged weights: nothing to compare
        return
    scale = max(1.0, float(padded[mask_BT].abs().max()))
    if not torch.allclose(packed[mask_BT], padded[mask_BT], rtol=1e-3, atol=1e-3 * scale):
        raise ValueError(
            f"{type(backbone).__name__} does not honour packed sequences (restarting position "
            "ids with attention_mask=None): its rows would attend across each other. Fix: set "
            "train.packing = false for this model"
        )
    _PACKING_VERIFIED.add(backbone)


def run_backbone_packed(
    backbone: nn.Module, tokens_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """Last hidden states ``[B, T, H]`` of a base model, computed padding-free:
    the same values as the padded forward at real tokens, 0 at padding.
    ``mask_BT`` must hold at least one real token."""
    verify_packing(backbone, tokens_BT.device)
    return _packed_hidden(backbone, tokens_BT, mask_BT)
