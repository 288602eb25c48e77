"""Activation checkpointing of a model's decoder layers (``train.activation_checkpointing``).

Each decoder layer's forward runs under :func:`torch.utils.checkpoint.checkpoint`
(non-reentrant) whenever gradients are on: the backward keeps only each
layer's input and recomputes the layer's activations when it reaches it.
Saved activations fall from every layer's (SmolLM2-135M in float32: ~45 KB per
token and layer) to the layer inputs plus one layer's; the price is one more
forward of the layers per backward. The values and gradients are the same (the
layers hold no dropout in the models sao trains; torch replays the RNG state
anyway). With grad off (the engine, values for GAE, evaluation) nothing changes.

Done here rather than with transformers' ``gradient_checkpointing_enable``,
which checkpoints only in ``train()`` mode and only for models whose layers
opted in; the trainer keeps its models in ``eval()`` mode.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_layers", "decoder_layers"]

_MARK = "_sao_checkpointed"


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: every element of each outermost ``nn.ModuleList``
    (``model.layers`` of Llama/Qwen, ``transformer.h`` of GPT-2)."""
    found: list[str] = []
    blocks: list[nn.Module] = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and not any(name.startswith(f + ".") for f in found):
            found.append(name)
            blocks.extend(m)
    return blocks


def _attention_configs(layer: nn.Module) -> list[Any]:
    """The distinct model configs the layer's modules read their attention
    implementation from (``config._attn_implementation``, at each forward)."""
    configs: dict[int, Any] = {}
    for m in layer.modules():
        config = getattr(m, "config", None)
        if hasattr(config, "_attn_implementation"):
            configs[id(config)] = config
    return list(configs.values())


@contextlib.contextmanager
def _attention_as(configs: list[Any], impls: list[str | None]) -> Iterator[None]:
    """While open, each of ``configs`` attends with the implementation in ``impls``."""
    before = [c._attn_implementation for c in configs]
    for c, impl in zip(configs, impls, strict=True):
        c._attn_implementation = impl
    try:
        yield
    finally:
        for c, impl in zip(configs, before, strict=True):
            c._attn_implementation = impl


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The layer class's own forward, under checkpointing when gradients are on.
    Bound to the layer as a method, so a deep copy of the model (the embedded
    engine's) rebinds it to the copy's own weights.

    The recompute in the backward attends as the forward did: a packed forward
    switches the attention implementation (``sao.models.packing``'s row-by-row
    attention) only while it runs, and the backward comes after; recomputed with
    the dense one, the packed rows would attend across each other."""
    forward = functools.partial(type(self).forward, self)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    configs = _attention_configs(self)
    impls = [c._attn_implementation for c in configs]

    def contexts() -> tuple[
        contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]
    ]:
        return contextlib.nullcontext(), _attention_as(configs, impls)

    return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def checkpoint_layers(model: nn.Module) -> int:
    """Checkpoint every decoder layer of ``model`` in place (once: a second call
    changes nothing); returns how many layers are checkpointed. A ValueError
    when the model has no repeated blocks to checkpoint."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no decoder layers (no nn.ModuleList of blocks) to "
            "checkpoint; set train.activation_checkpointing=false"
        )
    for layer in layers:
        if not getattr(layer, _MARK, False):
            layer.forward = types.MethodType(_checkpointed_forward, layer)
            setattr(layer, _MARK, True)
    return len(layers)
