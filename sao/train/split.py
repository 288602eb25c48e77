"""How a batch's rows are divided: across trainer ranks, then into micro-batches.

Pure functions of row lengths and group ids (plain Python, no tensors), so
every rank computes the *same* plan for every rank from the same batch, with
no communication: rank ``r`` trains ``split_rows(...)[r]``, and each rank knows
how many micro-batches the busiest rank runs (FSDP2's collectives need every
rank to run the same number of forward and backward passes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sao.types import Batch

__all__ = [
    "PACK_WASTE",
    "micro_batch_rows",
    "packed_micro_batch_rows",
    "padding_micro_batch",
    "padding_waste",
    "select_rows",
    "split_rows",
    "worth_packing",
]


def split_rows(
    lengths: Sequence[int], group_ids: Sequence[str], world_size: int
) -> list[list[int]]:
    """Row indices for each of ``world_size`` ranks: groups whole, tokens balanced.

    Rows sharing a non-empty ``group_id`` stay on one rank (a row with
    ``group_id == ""`` is its own unit). Units are placed longest first, each
    on the rank with the fewest tokens so far (Graham's LPT rule: at most 4/3
    of the optimal makespan); ties go to the lower rank, so the plan is
    deterministic. Each rank's rows come back in batch order. A rank may get
    no row (fewer units than ranks): it then runs padding micro-batches only.

    ``lengths``: real tokens per row (``B`` entries); ``group_ids``: ``B`` strings.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if len(lengths) != len(group_ids):
        raise ValueError(f"lengths has {len(lengths)} rows but group_ids has {len(group_ids)}")
    units: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        units.setdefault(g if g else f"\0row{i}", []).append(i)
    tokens = [0] * world_size
    plan: list[list[int]] = [[] for _ in range(world_size)]
    by_size = sorted(units.values(), key=lambda rows: (-sum(lengths[i] for i in rows), rows[0]))
    for rows in by_size:
        r = min(range(world_size), key=lambda k: (tokens[k], k))
        plan[r].extend(rows)
        tokens[r] += sum(lengths[i] for i in rows)
    return [sorted(rows) for rows in plan]


def micro_batch_rows(
    lengths: Sequence[int], rows: Sequence[int], token_budget: int
) -> list[list[int]]:
    """Split ``rows`` (sorted by length) into micro-batches whose padded size
    ``len(micro_batch) * longest_row`` fits ``token_budget``; a row longer than
    the budget forms its own micro-batch. ``lengths`` is indexed by row."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    out: list[list[int]] = []
    group: list[int] = []
    for i in sorted(rows, key=lambda i: lengths[i]):
        if group and (len(group) + 1) * max(lengths[i], 1) > token_budget:
            out.append(group)
            group = []
        group.append(i)
    if group:
        out.append(group)
    return out


def padding_waste(lengths: Sequence[int], token_budget: int) -> float:
    """The share of padding in the padded plan of a whole batch: its token
    slots (``len(micro_batch) * longest_row``, summed) over the real tokens, less 1."""
    plan = micro_batch_rows(lengths, range(len(lengths)), token_budget)
    slots = sum(len(rows) * max(max(lengths[i] for i in rows), 1) for rows in plan)
    return slots / max(sum(lengths), 1) - 1


PACK_WASTE = 0.15
"""``train.packing=auto`` packs a step whose padded plan would run at least
this share of padding. Without padding, the packed forward and backward run
at 0.87-0.90x the padded ones' tokens/s on the CPU (``benchmarks/packing.py``
on 64 rows of 96 tokens and on 4 x 1024 + 60 x 64); on calc-tiny's batches
(~70% padding) they take 1.3-1.8x less time, on long-tailed ones 2x
(``benchmarks/trainer_step.py``, BENCHMARKS.md)."""


def worth_packing(lengths: Sequence[int], token_budget: int) -> bool:
    """Whether ``train.packing=auto`` packs a batch of these row lengths (the
    whole batch's: every rank decides the same)."""
    return padding_waste(lengths, token_budget) >= PACK_WASTE


def packed_micro_batch_rows(
    lengths: Sequence[int], rows: Sequence[int], token_budget: int
) -> list[list[int]]:
    """Split ``rows`` into packed micro-batches of at most ``token_budget`` real
    tokens each (the sum of their lengths: no padding is run). First-fit
    decreasing: longest row first, into the first micro-batch it fits, else a
    new one (at most 11/9 of the optimal count plus one; deterministic, ties
    by row index). A row longer than the budget is its own micro-batch. Each
    micro-batch's rows come back sorted; ``lengths`` is indexed by row."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(rows, key=lambda i: (-lengths[i], i)):
        n = max(lengths[i], 1)
        k = next((k for k, u in enumerate(used) if u + n <= token_budget), len(bins))
        if k == len(bins):
            bins.append([])
            used.append(0)
        bins[k].append(i)
        used[k] += n
    return [sorted(b) for b in bins]


def select_rows(batch: Batch, rows: Sequence[int]) -> tuple[Batch, torch.Tensor]:
    """The micro-batch of ``rows``, with padding beyond its longest row trimmed,
    and ``rows`` as a long tensor on the batch's device (to write results back)."""
    idx = torch.tensor(list(rows), dtype=torch.long, device=batch.tokens_BT.device)
    T = max(int(batch.attention_mask_BT[idx].sum(dim=1).max()), 1)
    fields = {
        k: v[idx][:, :T] if v.ndim == 2 else v[idx]
        for k, v in vars(batch).items()
        if isinstance(v, torch.Tensor)
    }
    sub = Batch(
        **fields,
        prompt_ids=tuple(batch.prompt_ids[i] for i in rows),
        group_ids=tuple(batch.group_ids[i] for i in rows),
    )
    return sub, idx


def padding_micro_batch(batch: Batch) -> tuple[Batch, torch.Tensor]:
    """A stand-in micro-batch for a rank that has run out of rows: one row of
    two padding tokens (two, so a log-probability exists and the backward
    reaches every layer), no action token, and an *empty* row index, so
    results written back (``out[rows, :T] = x``) land nowhere and its loss is
    zero. It keeps the rank's forward/backward count equal to the others'."""
    T = min(2, int(batch.tokens_BT.shape[1]))
    dev = batch.tokens_BT.device

    def full(value: float | bool, like: torch.Tensor) -> torch.Tensor:
        return torch.full((1, T), value, dtype=like.dtype, device=dev)

    sub = Batch(
        tokens_BT=full(0, batch.tokens_BT),
        attention_mask_BT=full(True, batch.attention_mask_BT),
        action_mask_BT=full(False, batch.action_mask_BT),
        rollout_logp_BT=full(0.0, batch.rollout_logp_BT),
        version_BT=full(-1, batch.version_BT),
        rewards_BT=full(0.0, batch.rewards_BT),
        turn_id_BT=full(-1, batch.turn_id_BT),
        rewards_B=torch.zeros(1, dtype=batch.rewards_B.dtype, device=dev),
        truncated_B=torch.zeros(1, dtype=batch.truncated_B.dtype, device=dev),
        prompt_ids=("",),
        group_ids=("",),
    )
    return sub, torch.zeros(0, dtype=torch.long, device=dev)
