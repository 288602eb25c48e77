"""Tiny causal LMs built in code (random init, no download) for tests, demos
and CPU experiments.

Sizes (non-embedding parameters; embeddings add ``vocab_size * hidden``, once,
since input and output embeddings are tied):

======  ======  ======  =====  ============  ==========================
size    hidden  layers  heads  intermediate  non-embedding params
======  ======  ======  =====  ============  ==========================
0.1m        64       2      4           128  ~0.08M
0.5m       128       3      4           256  ~0.49M
1m         128       4      4           512  ~1.05M
2m         192       4      6           640  ~2.07M
5m         256       6      8           768  ~5.1M
======  ======  ======  =====  ============  ==========================

Per layer: attention ``4 * hidden^2`` (q, k, v, o; no grouped KV heads) plus
a gated MLP ``3 * hidden * intermediate``. Head dim is ``hidden / heads``
(16 or 32). Embeddings are tied [choice]: with vocabularies of 100-1000
tokens an untied head would add parameters that a tiny model cannot use, and
Qwen3's small checkpoints tie them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
)

__all__ = ["TINY_ARCHS", "TINY_SIZES", "TinyShape", "build_tiny_policy", "tiny_config"]

TinyArch = Literal["llama", "qwen3"]
TINY_ARCHS: tuple[str, ...] = ("llama", "qwen3")
MAX_POSITIONS = 2048


@dataclass(frozen=True)
class TinyShape:
    """Transformer dimensions of one tiny size."""

    hidden: int
    layers: int
    heads: int
    intermediate: int

    def non_embedding_params(self, arch: str = "llama") -> int:
        """Parameters outside the embeddings (layer weights and norms)."""
        h, i = self.hidden, self.intermediate
        per_layer = 4 * h * h + 3 * h * i + 2 * h
        if arch == "qwen3":
            per_layer += 2 * (h // self.heads)  # q_norm and k_norm
        return self.layers * per_layer + h  # + final norm


TINY_SIZES: dict[str, TinyShape] = {
    "0.1m": TinyShape(hidden=64, layers=2, heads=4, intermediate=128),
    "0.5m": TinyShape(hidden=128, layers=3, heads=4, intermediate=256),
    "1m": TinyShape(hidden=128, layers=4, heads=4, intermediate=512),
    "2m": TinyShape(hidden=192, layers=4, heads=6, intermediate=640),
    "5m": TinyShape(hidden=256, layers=6, heads=8, intermediate=768),
}


def tiny_config(
    arch: str = "llama",
    size: str = "1m",
    *,
    vocab_size: int,
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> PretrainedConfig:
    """A ``LlamaConfig`` or ``Qwen3Config`` of one of :data:`TINY_SIZES`.

    Tied embeddings, no dropout, ``max_position_embeddings = 2048``, float32.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {TINY_ARCHS}, got {arch!r}")
    if size not in TINY_SIZES:
        raise ValueError(f"size must be one of {tuple(TINY_SIZES)}, got {size!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    shape = TINY_SIZES[size]
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        dtype="float32",
    )
    if arch == "qwen3":
        return Qwen3Config(**common)
    return LlamaConfig(**common)


def build_tiny_policy(
    tokenizer: PreTrainedTokenizerBase,
    *,
    arch: str = "llama",
    size: str = "1m",
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised tiny causal LM sized to ``tokenizer``.

    Deterministic for a ``seed`` (the caller's global RNG state is left
    untouched). ``vocab_size = len(tokenizer)``; pad and eos ids come from the
    tokenizer, and generation stops on eos (``<|im_end|>`` for the built
    tokenizers). Save with ``save_pretrained``; reload with
    :func:`sao.models.load_policy`.
    """
    eos = tokenizer.eos_token_id
    config = tiny_config(
        arch,
        size,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    return model.eval()
