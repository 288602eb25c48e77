"""Logits processing, sampling and stop conditions for the embedded engine.

The distribution the engine samples from is defined here, once, so that the
trainer can reproduce it (ALGORITHMS.md section 6): temperature, then top-k,
then top-p (the order Hugging Face ``generate`` and vLLM use), all in fp32.
The returned log-probability of a sampled token is its log-probability under
that final, renormalised distribution, which is what the DIS ratio
``exp(logp - rollout_logp)`` divides by (ALGORITHMS.md section 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Detokenizer(Protocol):
    """Anything with ``decode(ids) -> str``: a ``transformers`` tokenizer or a
    ``tokenizers.Tokenizer``."""

    def decode(self, token_ids: list[int], /) -> object: ...


def sampling_logprobs(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
) -> torch.Tensor:
    """Log-probabilities of the distribution each row samples from.

    ``logits_BV`` [B, V] (any float dtype, processed in fp32); ``temperature_B``
    [B] float (> 0); ``top_k_B`` [B] long (0 disables); ``top_p_B`` [B] float in
    (0, 1] (1 disables). Returns ``logp_BV`` [B, V] fp32: ``log_softmax(logits /
    T)`` restricted to the kept tokens and renormalised over them; dropped
    tokens get ``-inf``.

    top-k keeps every token whose scaled logit is >= the k-th largest (ties at
    the boundary are kept, as in ``transformers.TopKLogitsWarper``). top-p then
    keeps, in decreasing order of probability under the top-k distribution, the
    smallest prefix whose mass reaches ``p``: token ``i`` is kept iff the mass
    strictly before it is < ``p`` (Holtzman et al. 2020, "The Curious Case of
    Neural Text Degeneration", section 3.1; same rule as
    ``transformers.TopPLogitsWarper``). The most likely token is always kept.
    """
    scaled_BV = logits_BV.float() / temperature_B.float().unsqueeze(-1)
    V = scaled_BV.shape[-1]
    use_k_B = (top_k_B > 0) & (top_k_B < V)
    use_p_B = top_p_B < 1.0
    if not bool(use_k_B.any()) and not bool(use_p_B.any()):
        return torch.log_softmax(scaled_BV, dim=-1)
    if not bool(use_p_B.any()):  # top-k alone: the k-th largest needs no full sort
        k_B = torch.where(use_k_B, top_k_B, 1).clamp(1, V)
        top_BK = torch.topk(scaled_BV, int(k_B.max()), dim=-1).values
        kth_B1 = top_BK.gather(-1, (k_B - 1).unsqueeze(-1))
        kth_B1 = torch.where(use_k_B.unsqueeze(-1), kth_B1, float("-inf"))
        return torch.log_softmax(scaled_BV.masked_fill(scaled_BV < kth_B1, float("-inf")), dim=-1)
    sorted_BV, order_BV = torch.sort(scaled_BV, dim=-1, descending=True)
    keep_sorted_BV = torch.ones_like(sorted_BV, dtype=torch.bool)
    if bool(use_k_B.any()):
        k_B = torch.where(use_k_B, top_k_B, V).clamp(1, V)
        kth_B = sorted_BV.gather(-1, (k_B - 1).unsqueeze(-1))
        keep_sorted_BV &= sorted_BV >= kth_B
    if bool(use_p_B.any()):
        masked_BV = sorted_BV.masked_fill(~keep_sorted_BV, float("-inf"))
        probs_BV = torch.softmax(masked_BV, dim=-1)
        mass_before_BV = torch.cumsum(probs_BV, dim=-1) - probs_BV
        keep_p_BV = (mass_before_BV < top_p_B.float().unsqueeze(-1)) | ~use_p_B.unsqueeze(-1)
        keep_p_BV[:, 0] = True
        keep_sorted_BV &= keep_p_BV
    keep_BV = torch.zeros_like(keep_sorted_BV).scatter_(-1, order_BV, keep_sorted_BV)
    return torch.log_softmax(scaled_BV.masked_fill(~keep_BV, float("-inf")), dim=-1)


def sample_tokens(logp_BV: torch.Tensor, u_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row by inverting the CDF at the uniform ``u_B``.

    ``logp_BV`` [B, V] fp32 from :func:`sampling_logprobs`; ``u_B`` [B] uniform
    in [0, 1), drawn by the caller from each request's own generator so a
    row's token depends only on its own seed and logits. Returns ``token_B``
    [B] long and its ``logp_B`` [B] fp32 (the log-probability under the
    distribution sampled from). Token ``i`` is chosen iff ``cdf[i-1] <= u *
    cdf[-1] < cdf[i]``, so a token of probability 0 is never chosen.
    """
    probs_BV = logp_BV.exp()
    cdf_BV = torch.cumsum(probs_BV, dim=-1)
    target_B1 = (u_B.to(cdf_BV).unsqueeze(-1) * cdf_BV[:, -1:]).contiguous()
    token_B = torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(-1)
    token_B = token_B.clamp_(max=logp_BV.shape[-1] - 1)
    # Rounding can only push the draw past the last kept token; fall back to the mode.
    logp_B = logp_BV.gather(-1, token_B.unsqueeze(-1)).squeeze(-1)
    bad_B = ~torch.isfinite(logp_B)
    if bool(bad_B.any()):
        token_B = torch.where(bad_B, logp_BV.argmax(-1), token_B)
        logp_B = logp_BV.gather(-1, token_B.unsqueeze(-1)).squeeze(-1)
    return token_B, logp_B


class StopStringMatcher:
    """Incremental detokenisation of one request's generated tokens, reporting
    when any stop string appears in the generated text.

    Each new token decodes only a short window (the previous emitted chunk and
    the new tokens), following the prefix/read-offset scheme of text-generation
    servers, so the cost per token does not grow with the length. Text ending in
    an incomplete UTF-8 sequence (``"\\ufffd"``) waits for the next token. The
    tokens themselves are never trimmed: they were sampled and carry
    log-probabilities.
    """

    def __init__(self, tokenizer: Detokenizer, stop_strings: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(stop_strings)
        self._longest = max(len(s) for s in self._stops)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""

    def push(self, token_id: int) -> bool:
        """Append one generated token; True once a stop string is in the text."""
        self._ids.append(token_id)
        prefix = str(self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset]))
        full = str(self._tokenizer.decode(self._ids[self._prefix_offset :]))
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        start = max(0, len(self.text) - self._longest + 1)
        self.text += delta
        window = self.text[start:]
        return any(s in window for s in self._stops)


def default_stop_ids(
    model_config: object, generation_config: object, tokenizer: object
) -> tuple[int, ...]:
    """The eos ids used when a request gives no ``stop_token_ids``.

    First found of: ``generation_config.eos_token_id``, ``config.eos_token_id``,
    ``tokenizer.eos_token_id`` (each an int or a list of ints). Empty when none
    is set: generation then runs to ``max_new_tokens``.
    """
    for source in (generation_config, model_config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is None:
            continue
        ids = (eos,) if isinstance(eos, int) else tuple(int(i) for i in eos)
        if ids:
            return ids
    return ()
