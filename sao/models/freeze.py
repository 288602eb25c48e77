"""Freezing the critic's attention (token-mixing) parameters.

SAO trains the value model with its attention frozen (ALGORITHMS.md section 4,
"Frozen attention" [paper]): the q/k/v/o projections with their biases, the
q/k norms, and the norm that feeds attention stop training; MLP / expert
projections, the final norm and the value head keep training. Embeddings stay
trainable [choice]: they are not token mixing, and freezing them would stop
the critic from adapting token features it reads through the MLPs.

Call :func:`freeze_attention` **before** the optimizer is built: an optimizer
built earlier keeps the frozen tensors in its parameter groups, and weight
decay would still move them.

Parameters are grouped by the module names of the supported layouts:

============  ===================================  ==================================
layout        attention (group ``attention``)      attention norm (``attention_norm``)
============  ===================================  ==================================
Llama, Qwen2  ``self_attn.{q,k,v,o}_proj``          ``input_layernorm``
Qwen3         ... plus ``self_attn.{q,k}_norm``     ``input_layernorm``
Mistral       ``self_attn.*``                       ``input_layernorm``
Gemma 1/2/3   ``self_attn.*``                       ``input_layernorm``; Gemma 2/3 also
                                                    ``post_attention_layernorm`` (it
                                                    normalises the attention output)
GPT-2         ``attn.c_attn``, ``attn.c_proj``      ``ln_1``
GPT-NeoX      ``attention.query_key_value``,        ``input_layernorm``
              ``attention.dense``
============  ===================================  ==================================

The norm before the MLP (``post_attention_layernorm`` in Llama-style layers,
``ln_2``, ``pre_/post_feedforward_layernorm``) is counted in group ``mlp``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

__all__ = [
    "FREEZE_GROUPS",
    "FreezeReport",
    "classify_parameter",
    "freeze_attention",
    "freeze_below",
    "layer_stack",
]

FREEZE_GROUPS: tuple[str, ...] = (
    "attention",
    "attention_norm",
    "mlp",
    "embeddings",
    "final_norm",
    "head",
    "other",
)
FROZEN_GROUPS = frozenset({"attention", "attention_norm"})

_ATTENTION = frozenset({"self_attn", "attn", "attention", "self_attention"})
_ATTENTION_NORM = frozenset({"input_layernorm", "ln_1"})
_MLP = frozenset(
    {
        "mlp",
        "feed_forward",
        "block_sparse_moe",
        "experts",
        "post_attention_layernorm",
        "ln_2",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    }
)
_EMBEDDINGS = frozenset({"embed_tokens", "wte", "wpe", "embed_in", "embed_positions"})
_FINAL_NORM = frozenset({"norm", "ln_f", "final_layer_norm", "final_layernorm"})
_HEAD = frozenset({"lm_head", "embed_out", "value_head", "score"})
# A layer with this child uses "sandwich" norms: its post_attention_layernorm
# normalises the attention output (Gemma 2/3), so it belongs to attention.
_SANDWICH_MARKER = "pre_feedforward_layernorm"


@dataclass(frozen=True)
class FreezeReport:
    """What :func:`freeze_attention` froze: element counts by group and names."""

    frozen: dict[str, int] = field(default_factory=dict)
    trainable: dict[str, int] = field(default_factory=dict)
    frozen_names: tuple[str, ...] = ()

    @property
    def num_frozen(self) -> int:
        """Frozen parameter elements in total."""
        return sum(self.frozen.values())

    @property
    def num_trainable(self) -> int:
        """Trainable parameter elements in total."""
        return sum(self.trainable.values())

    def summary(self) -> str:
        """One line per group: ``group: frozen / trainable``."""
        rows = [
            f"{g}: frozen {self.frozen[g]:,} / trainable {self.trainable[g]:,}"
            for g in FREEZE_GROUPS
            if self.frozen[g] or self.trainable[g]
        ]
        return "\n".join(rows)


def classify_parameter(name: str, module_names: frozenset[str] = frozenset()) -> str:
    """The group (one of :data:`FREEZE_GROUPS`) of parameter ``name``.

    The first dotted segment (from the root) naming a known module decides.
    ``module_names`` (all module paths of the model) lets a Gemma-2/3 layer's
    ``post_attention_layernorm`` be recognised as an attention norm.
    """
    parts = name.split(".")
    inside_layer = any(p.isdigit() for p in parts)
    for i, part in enumerate(parts[:-1]):
        if part in _ATTENTION:
            return "attention"
        if part in _ATTENTION_NORM:
            return "attention_norm"
        if part == "post_attention_layernorm":
            layer = ".".join(parts[:i])
            sandwich = f"{layer}.{_SANDWICH_MARKER}" if layer else _SANDWICH_MARKER
            return "attention_norm" if sandwich in module_names else "mlp"
        if part in _MLP:
            return "mlp"
        if part in _EMBEDDINGS:
            return "embeddings"
        if part in _HEAD:
            return "head"
        if part in _FINAL_NORM and not inside_layer:
            return "final_norm"
    return "other"


def _layout(model: nn.Module) -> str:
    """Where the first layer stack is and its first layer's child modules."""
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            children = [n for n, _ in module[0].named_children()]
            return f"first layer {path}.0 ({type(module[0]).__name__}) has children {children}"
    return f"top-level children {[n for n, _ in model.named_children()]}"


def freeze_attention(model: nn.Module) -> FreezeReport:
    """Set ``requires_grad = False`` on the attention and attention-norm
    parameters of ``model`` (a causal LM or a :class:`ValueModel`).

    Must run before the optimizer is built. Raises ``ValueError`` naming the
    module layout when no attention parameter is recognised (an unknown
    architecture is never a silent no-op). Idempotent.
    """
    module_names = frozenset(n for n, _ in model.named_modules())
    frozen = dict.fromkeys(FREEZE_GROUPS, 0)
    trainable = dict.fromkeys(FREEZE_GROUPS, 0)
    named = list(model.named_parameters())
    groups = {name: classify_parameter(name, module_names) for name, _ in named}
    if not any(g == "attention" for g in groups.values()):
        raise ValueError(
            f"freeze_attention: no attention parameters recognised in {type(model).__name__}; "
            f"{_layout(model)}. Known attention modules: {sorted(_ATTENTION)}, attention norms: "
            f"{sorted(_ATTENTION_NORM)}. Fix: add this layout's names to sao.models.freeze"
        )
    frozen_names = []
    for name, param in named:
        group = groups[name]
        if group in FROZEN_GROUPS:
            param.requires_grad_(False)
            frozen_names.append(name)
        counts = frozen if not param.requires_grad else trainable
        counts[group] += param.numel()
    return FreezeReport(frozen=frozen, trainable=trainable, frozen_names=tuple(frozen_names))


def layer_stack(model: nn.Module) -> tuple[str, int]:
    """The path and length of ``model``'s decoder layer stack (its first non-empty
    ``ModuleList``)."""
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return path, len(module)
    raise ValueError(
        f"no layer stack (an nn.ModuleList of decoder layers) in {type(model).__name__}; "
        f"{_layout(model)}"
    )


def freeze_below(model: nn.Module, top_layers: int) -> FreezeReport:
    """Freeze every parameter of ``model`` except those of its top ``top_layers``
    decoder layers, its final norm and its head (a cheaper critic: the backward
    stops at the lowest trained layer). Layers' own freezing (attention, see
    :func:`freeze_attention`) is left as it is. Idempotent; call it before the
    optimizer is built. A ``top_layers`` above the model's layer count is a
    ``ValueError`` naming the count."""
    path, n = layer_stack(model)
    if not 1 <= top_layers <= n:
        raise ValueError(f"top_layers must be in [1, {n}] ({type(model).__name__} has {n} layers)")
    module_names = frozenset(name for name, _ in model.named_modules())
    kept = tuple(f"{path}.{i}." for i in range(n - top_layers, n))
    frozen = dict.fromkeys(FREEZE_GROUPS, 0)
    trainable = dict.fromkeys(FREEZE_GROUPS, 0)
    frozen_names = []
    for name, param in model.named_parameters():
        group = classify_parameter(name, module_names)
        top = name.startswith(kept) or group in ("final_norm", "head")
        if not top:
            param.requires_grad_(False)
        if not param.requires_grad:
            frozen_names.append(name)
        (trainable if param.requires_grad else frozen)[group] += param.numel()
    return FreezeReport(frozen=frozen, trainable=trainable, frozen_names=tuple(frozen_names))
