"""Supervised fine-tuning on chat conversations, loss on assistant tokens only.

Used to warm-start tiny policies on each environment's demonstrations before
RL. The loss is the token mean of ``-log p(token_t | tokens_<t)`` over the
tokens the chat template marks as assistant output (reply text plus its
closing ``<|im_end|>``), computed with :func:`sao.models.sequence_logprobs`
(so SFT and RL score tokens by the same code). Batches group conversations of
similar length (sorted by length, random tie-breaking, batch order shuffled)
and are padded per batch, which keeps padding low on CPU.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sao.models.logprobs import sequence_logprobs
from sao.models.tokenization import require_chat_template
from sao.types import Message

__all__ = ["EncodedConversation", "SFTReport", "encode_conversation", "sft"]


@dataclass(frozen=True)
class EncodedConversation:
    """A tokenised conversation and which tokens carry the SFT loss."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[bool, ...]


@dataclass(frozen=True)
class SFTReport:
    """Outcome of :func:`sft`. Losses are token-mean negative log-likelihoods
    over assistant tokens (nats per token)."""

    initial_loss: float
    final_loss: float
    epoch_losses: tuple[float, ...]
    steps: int
    examples: int
    skipped: int
    tokens: int
    loss_tokens: int
    seconds: float
    tokens_per_s: float


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase, conversation: Sequence[Message], *, max_len: int
) -> EncodedConversation:
    """Token ids of ``conversation`` rendered by the chat template (at most
    ``max_len``, cut on the right) and its loss mask: True on assistant tokens
    (``{% generation %}`` marks), never on position 0 (nothing predicts it)."""
    require_chat_template(tokenizer, what="encode_conversation")
    if not conversation or not all(isinstance(m, Message) for m in conversation):
        raise TypeError(
            "conversation must be a non-empty sequence of sao.types.Message, got "
            f"{[type(m).__name__ for m in conversation]}"
        )
    out = tokenizer.apply_chat_template(
        [m.as_dict() for m in conversation],
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    if not isinstance(out, Mapping):
        raise TypeError(f"apply_chat_template returned {type(out).__name__}, expected a mapping")
    ids = [int(i) for i in out["input_ids"]]
    mask = [bool(x) for x in out["assistant_masks"]]
    if not any(mask) and any(m.role == "assistant" for m in conversation):
        raise ValueError(
            "encode_conversation: the tokenizer's chat template marks no assistant token; it "
            "must wrap assistant content in {% generation %}...{% endgeneration %} (as "
            "sao.models.CHAT_TEMPLATE does). Fix: set tokenizer.chat_template accordingly"
        )
    ids, mask = ids[:max_len], mask[:max_len]
    if mask:
        mask[0] = False
    return EncodedConversation(token_ids=tuple(ids), loss_mask=tuple(mask))


def _length_batches(
    lengths: Sequence[int], batch_size: int, gen: torch.Generator
) -> list[list[int]]:
    """Index batches of similar length: random order, stable sort by length,
    cut into ``batch_size`` pieces, then the pieces shuffled."""
    perm = torch.randperm(len(lengths), generator=gen).tolist()
    order = sorted(perm, key=lambda i: lengths[i])
    batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]


def _collate(
    examples: Sequence[EncodedConversation], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to the longest example: ``tokens_BT``, ``attention_mask_BT``, ``loss_mask_BT``."""
    T = max(len(e.token_ids) for e in examples)
    tokens_BT = torch.full((len(examples), T), pad_id, dtype=torch.long)
    attn_BT = torch.zeros((len(examples), T), dtype=torch.bool)
    loss_BT = torch.zeros((len(examples), T), dtype=torch.bool)
    for b, e in enumerate(examples):
        n = len(e.token_ids)
        tokens_BT[b, :n] = torch.tensor(e.token_ids)
        attn_BT[b, :n] = True
        loss_BT[b, :n] = torch.tensor(e.loss_mask)
    return tokens_BT.to(device), attn_BT.to(device), loss_BT.to(device)


def _prepare(
    tokenizer: PreTrainedTokenizerBase, conversations: Sequence[Sequence[Message]], max_len: int
) -> tuple[list[EncodedConversation], int, int]:
    """Encode conversations; returns (examples with a loss token, skipped count, pad id)."""
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        raise ValueError("sft: tokenizer has no pad token; set tokenizer.pad_token")
    encoded = [encode_conversation(tokenizer, c, max_len=max_len) for c in conversations]
    examples = [e for e in encoded if any(e.loss_mask)]
    if not examples:
        raise ValueError(
            f"sft: none of the {len(encoded)} conversations has an assistant token within "
            f"max_len={max_len}; pass conversations with assistant replies or raise max_len"
        )
    return examples, len(encoded) - len(examples), int(pad_id)


def _check_args(
    epochs: int, lr: float, batch_size: int, max_len: int, warmup: float, schedule: str
) -> None:
    for name, value in (("epochs", epochs), ("batch_size", batch_size), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"sft: {name} must be an int >= 1, got {value!r}")
    if not (isinstance(lr, (int, float)) and 0 < lr < float("inf")):
        raise ValueError(f"sft: lr must be a finite number > 0, got {lr!r}")
    if not (isinstance(warmup, (int, float)) and 0 <= warmup < 1):
        raise ValueError(f"sft: warmup_frac must be in [0, 1), got {warmup!r}")
    if schedule not in ("linear", "constant"):
        raise ValueError(f"sft: schedule must be 'linear' or 'constant', got {schedule!r}")


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("sft epoch {task.fields[epoch]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TimeRemainingColumn(),
        disable=not enabled,
    )


def _linear_schedule(total: int, warmup_frac: float) -> Callable[[int], float]:
    """LR multiplier at step ``s``: linear warm-up over ``warmup`` steps, then
    linear decay, reaching zero after ``total`` steps."""
    warmup = max(1, round(warmup_frac * total))

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return max(0.0, (total - s) / max(1, total - warmup))

    return factor


def _optimizer(
    model: PreTrainedModel, lr: float, schedule: str, total: int, warmup_frac: float
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (no weight decay) over the trainable parameters and its LR schedule."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    factor = _linear_schedule(total, warmup_frac) if schedule == "linear" else _constant
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _constant(step: int) -> float:
    return 1.0


@dataclass
class _Tally:
    """Running counts across epochs."""

    steps: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    initial_loss: float = float("nan")


def _train_epoch(
    model: PreTrainedModel,
    opt: tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler],
    batches: Sequence[Sequence[EncodedConversation]],
    pad_id: int,
    max_grad_norm: float,
    tally: _Tally,
    progress: tuple[Progress, TaskID],
) -> float:
    """One pass over ``batches``; returns the token-mean loss of the epoch."""
    device = next(model.parameters()).device
    optimizer, scheduler = opt
    params = [p for group in optimizer.param_groups for p in group["params"]]
    loss_sum, count = 0.0, 0
    for batch in batches:
        tokens_BT, attn_BT, loss_BT = _collate(batch, pad_id, device)
        logp_BT = sequence_logprobs(model, tokens_BT, attn_BT)
        n = int(loss_BT.sum())
        loss = -(logp_BT * loss_BT).sum() / n
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        scheduler.step()
        value = float(loss.detach())
        if tally.steps == 0:
            tally.initial_loss = value
        tally.steps += 1
        tally.tokens += int(attn_BT.sum())
        tally.loss_tokens += n
        loss_sum, count = loss_sum + value * n, count + n
        progress[0].update(progress[1], advance=1, loss=value)
    return loss_sum / count


def sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Sequence[Message]],
    *,
    epochs: int = 1,
    lr: float = 1e-3,
    batch_size: int = 16,
    max_len: int = 512,
    seed: int = 0,
    max_grad_norm: float = 1.0,
    schedule: Literal["linear", "constant"] = "linear",
    warmup_frac: float = 0.03,
    progress: bool = True,
) -> SFTReport:
    """Fine-tune ``model`` in place on ``conversations`` (AdamW, no weight
    decay, gradient norm clipped to ``max_grad_norm``). ``schedule="linear"``:
    the LR warms up to ``lr`` over the first ``warmup_frac`` of the steps, then
    decays linearly to zero. Batches hold conversations of similar length, which
    often share behaviour (e.g. all answer early), so with a constant LR the last
    batches decide such choices; the decay keeps the policy calibrated to the data.

    Loss per step: ``-sum(mask * logp) / sum(mask)`` over the batch's
    assistant tokens. Conversations with no assistant token (after
    truncation to ``max_len``) are skipped and counted. Deterministic for a
    ``seed`` given the same starting weights.
    """
    _check_args(epochs, lr, batch_size, max_len, warmup_frac, schedule)
    examples, skipped, pad_id = _prepare(tokenizer, conversations, max_len)
    gen = torch.Generator().manual_seed(seed)
    total = epochs * math.ceil(len(examples) / batch_size)
    opt = _optimizer(model, lr, schedule, total, warmup_frac)
    lengths = [len(e.token_ids) for e in examples]
    was_training, tally, epoch_losses = model.training, _Tally(), []
    model.train()
    start = time.perf_counter()
    try:
        with _progress(progress) as bar:
            for epoch in range(epochs):
                idx_batches = _length_batches(lengths, batch_size, gen)
                task = bar.add_task("sft", total=len(idx_batches), epoch=epoch + 1, loss=math.nan)
                batches = [[examples[i] for i in idx] for idx in idx_batches]
                loss = _train_epoch(model, opt, batches, pad_id, max_grad_norm, tally, (bar, task))
                epoch_losses.append(loss)
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start
    return SFTReport(
        initial_loss=tally.initial_loss,
        final_loss=epoch_losses[-1],
        epoch_losses=tuple(epoch_losses),
        steps=tally.steps,
        examples=len(examples),
        skipped=skipped,
        tokens=tally.tokens,
        loss_tokens=tally.loss_tokens,
        seconds=seconds,
        tokens_per_s=tally.tokens / max(seconds, 1e-9),
    )
