"""LoRA adapters (``peft``) on the policy or the critic's backbone.

The adapters are injected into the model in place
(:func:`peft.inject_adapter_in_model`): the model keeps its class, its
``base_model`` and its forward, so log-probabilities and values are computed
by the same code as for full fine-tuning; only the adapter parameters (and,
for the critic, the final norm) have ``requires_grad``. Each adapted linear
module computes ``W x + (alpha / r) * B (A x)`` with ``W`` frozen.

The engines never run adapters: they hold plain weights, and an update sends
either the adapted modules' merged weights ``W + (alpha / r) * B @ A`` under the
plain model's names (:class:`MergedWeights`, :func:`published_state`: a
subset of the state dict that every engine applies in place) or, to a server
that merges them itself (``sao serve``), the adapters alone
(:func:`adapter_update`). Modules without an adapter (embeddings, norms, the
head) never change, so they are never sent. A LoRA critic on the same
checkpoint shares the LoRA actor's frozen base (:func:`share_frozen_base`).

On disk (:func:`save_adapter`): peft's format, ``adapter_config.json`` (its
``base_model_name_or_path`` the base checkpoint's directory) and
``adapter_model.safetensors``, loadable with ``PeftModel.from_pretrained``;
plus ``trained_base.safetensors`` when base parameters train too (the
critic's final norm).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from sao.models.cache import atomic_dir
from sao.models.freeze import FROZEN_GROUPS, classify_parameter

# peft (~1.5 s to import) is imported where an adapter is made, saved or read: a run
# without LoRA never imports it.

__all__ = [
    "ADAPTER_CONFIG",
    "LoraReport",
    "MergedWeights",
    "adapter_base",
    "adapter_update",
    "add_lora",
    "engine_model",
    "export_policy",
    "has_lora",
    "load_adapter",
    "merged_copy",
    "merged_from_state",
    "merged_weights",
    "plain_state",
    "published_state",
    "save_adapter",
    "save_policy",
    "share_frozen_base",
    "target_modules",
]

ADAPTER = "default"
"""The one adapter's name inside peft."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TRAINED_BASE = "trained_base.safetensors"
PEFT_PREFIX = "base_model.model."
"""peft names a saved tensor by its path inside a ``PeftModel``; the injected
model is that ``PeftModel``'s ``base_model.model``."""


@dataclass(frozen=True)
class LoraReport:
    """What :func:`add_lora` adapted."""

    targets: tuple[str, ...]
    """Full names of the adapted modules."""
    adapter_params: int
    trainable_params: int
    total_params: int

    def describe(self) -> str:
        share = self.trainable_params / max(1, self.total_params)
        return (
            f"{len(self.targets)} modules adapted, {self.trainable_params:,} of "
            f"{self.total_params:,} parameters trainable ({share:.2%})"
        )


def _linears(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of every linear module of ``model`` (``nn.Linear``, GPT-2's
    ``Conv1D``) but its output head (peft's ``all-linear`` leaves it out too: the
    head of a tied model is the embedding)."""
    from transformers.pytorch_utils import Conv1D

    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    out: dict[str, tuple[int, int]] = {}
    for name, m in model.named_modules():
        if m is head or not name:
            continue
        if isinstance(m, nn.Linear):
            out[name] = (m.in_features, m.out_features)
        elif isinstance(m, Conv1D):  # weight [in, out]
            out[name] = (int(m.weight.shape[0]), int(m.weight.shape[1]))
    return out


def target_modules(
    model: nn.Module,
    rank: int,
    targets: list[str] | str,
    *,
    skip_attention: bool = False,
) -> list[str]:
    """Full names of the modules to adapt. ``targets``: last names (``q_proj``)
    or ``"all-linear"``; ``skip_attention`` leaves attention projections out
    (a critic whose attention is frozen). Raises ``ValueError`` for a name the
    model lacks (listing the ones it has), for a rank larger than a module's
    smaller dimension, or when nothing is left to adapt."""
    linears = _linears(model)
    leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
    if targets == "all-linear":
        wanted = set(leaves)
    else:
        unknown = [t for t in targets if t not in leaves]
        if unknown:
            raise ValueError(
                f"unknown target module(s) {unknown}: {type(model).__name__}'s linear modules "
                f"are {leaves} (or use all-linear)"
            )
        wanted = set(targets)
    chosen = [
        name
        for name in linears
        if name.rsplit(".", 1)[-1] in wanted
        and not (skip_attention and classify_parameter(f"{name}.weight") in FROZEN_GROUPS)
    ]
    if not chosen:
        raise ValueError(
            f"no module left to adapt among {sorted(wanted)}"
            + (": attention is frozen, so adapt MLP modules" if skip_attention else "")
        )
    for name in chosen:
        n_in, n_out = linears[name]
        if rank > min(n_in, n_out):
            raise ValueError(
                f"rank {rank} is larger than {name}'s smaller dimension {min(n_in, n_out)} "
                f"({n_in} -> {n_out}); lower the rank or leave the module out"
            )
    return chosen


def add_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    targets: list[str] | str = "all-linear",
    skip_attention: bool = False,
    train_final_norm: bool = False,
    seed: int = 0,
) -> LoraReport:
    """Inject one LoRA adapter per target module into ``model`` in place and
    freeze everything else (``train_final_norm``: the final norm keeps training,
    as a critic's does). ``A`` is drawn deterministically for ``seed``
    (Kaiming uniform, peft's default) and ``B`` is 0, so the model computes
    exactly what it did before. Call before the optimizer is built."""
    from peft import LoraConfig, inject_adapter_in_model

    if has_lora(model):
        raise ValueError(f"{type(model).__name__} already has a LoRA adapter")
    chosen = target_modules(model, rank, targets, skip_attention=skip_attention)
    from transformers.pytorch_utils import Conv1D

    conv = any(isinstance(model.get_submodule(n), Conv1D) for n in chosen)  # weight [in, out]
    settings: dict[str, Any] = dict(r=rank, lora_alpha=alpha, lora_dropout=0.0)  # float alpha
    config = LoraConfig(**settings, target_modules=chosen, fan_in_fan_out=conv)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    if train_final_norm:
        for name, p in model.named_parameters():
            if classify_parameter(name) == "final_norm":
                p.requires_grad_(True)
    adapter = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return LoraReport(tuple(chosen), adapter, trainable, total)


def has_lora(model: nn.Module) -> bool:
    """True when ``model`` holds a LoRA adapter (:func:`add_lora`; peft keeps its
    config on the model)."""
    return hasattr(model, "peft_config")


def _adapted(model: nn.Module) -> dict[str, Any]:
    """Adapted modules (peft ``LoraLayer``) by full name."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


class MergedWeights(Mapping[str, torch.Tensor]):
    """``{"<module>.weight": W + (alpha / r) * B @ A}`` for every adapted module of
    a LoRA model, under the plain model's names, each computed when it is read:
    an engine copying them one by one holds one merged module at a time, not a
    second copy of every adapted weight. Read it before the adapters change."""

    def __init__(self, model: nn.Module) -> None:
        self._layers = {f"{n}.weight": layer for n, layer in _adapted(model).items()}
        self.shapes = {k: layer.get_base_layer().weight.shape for k, layer in self._layers.items()}

    def __getitem__(self, key: str) -> torch.Tensor:
        layer = self._layers[key]
        base = layer.get_base_layer()
        with torch.no_grad():
            return base.weight + layer.get_delta_weight(ADAPTER).to(base.weight.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)


def adapter_update(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """The adapters alone, for an engine that merges them itself
    (:func:`sao.rollout.weights.merge_adapter`): ``{"<module>.lora_A": A,
    "<module>.lora_B": B}`` (float32 copies on the CPU) and ``{"scaling": {module:
    alpha / r}, "fan_in_fan_out": bool}``.
    For rank 8 on every linear layer of SmolLM2-135M: 9.8 MB, against 425 MB of
    merged weights."""
    tensors: dict[str, torch.Tensor] = {}
    scaling: dict[str, float] = {}
    fan_in_fan_out = False
    for name, layer in _adapted(model).items():
        tensors[f"{name}.lora_A"] = layer.lora_A[ADAPTER].weight.detach().float().cpu().clone()
        tensors[f"{name}.lora_B"] = layer.lora_B[ADAPTER].weight.detach().float().cpu().clone()
        scaling[name] = float(layer.scaling[ADAPTER])
        fan_in_fan_out = fan_in_fan_out or bool(getattr(layer, "fan_in_fan_out", False))
    return tensors, {"scaling": scaling, "fan_in_fan_out": fan_in_fan_out}


def _delta(layer: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(alpha / r) * B @ A`` of one adapted module from its factors, laid out as
    its base weight (peft's ``get_delta_weight``)."""
    delta = (b.float() @ a.float()) * float(layer.scaling[ADAPTER])
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


@torch.no_grad()
def merged_from_state(
    model: nn.Module, state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """:func:`merged_weights` computed from ``state``, a state dict of ``model``
    under its own names (a sharded model's gathered one: ``model``'s own
    parameters are shards, only its adapter layout and scalings are read)."""
    out = {}
    for name, layer in _adapted(model).items():
        base = state[f"{name}.base_layer.weight"]
        a = state[f"{name}.lora_A.{ADAPTER}.weight"]
        b = state[f"{name}.lora_B.{ADAPTER}.weight"]
        out[f"{name}.weight"] = (base.float() + _delta(layer, a, b)).to(base.dtype)
    return out


def plain_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain model's whole state dict from a LoRA ``model``'s ``state``: no
    adapter tensors, ``base_layer`` names back to the plain ones, the adapted
    weights merged (what :func:`merged_copy` holds, without a second model)."""
    merged = merged_from_state(model, state)
    out = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        plain = key.replace(".base_layer.", ".")
        out[plain] = merged.get(plain, value)
    return out


def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every merged adapted weight of ``model`` at once (:class:`MergedWeights`):
    what an engine holding the plain model needs to compute what ``model`` does."""
    return dict(MergedWeights(model))


@torch.no_grad()
def merged_copy(model: nn.Module) -> nn.Module:
    """A plain copy of ``model`` (no adapter modules, no peft config) whose
    adapted weights are merged: what the embedded engine runs and what
    ``final/`` saves."""
    plain = copy.deepcopy(model)
    for name, layer in _adapted(plain).items():
        base = layer.get_base_layer()
        base.weight.add_(layer.get_delta_weight(ADAPTER).to(base.weight.dtype))
        parent, _, child = name.rpartition(".")
        setattr(plain.get_submodule(parent) if parent else plain, child, base)
    if hasattr(plain, "peft_config"):
        del plain.peft_config
    for p in plain.parameters():
        p.requires_grad_(True)  # as a freshly loaded model; the engine runs without grad
    return plain


def save_adapter(
    model: nn.Module,
    directory: str | os.PathLike[str],
    base: str | Path | None = None,
    *,
    state: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model``'s adapter in peft's format to ``directory`` atomically,
    ``base`` (default: the directory ``model`` was loaded from) recorded as
    ``base_model_name_or_path``; base parameters that train too (a critic's
    final norm) go in ``trained_base.safetensors``. ``state``: take the tensors
    from this state dict of ``model`` (a sharded model's gathered one)."""
    from peft import get_peft_model_state_dict

    config: Any = copy.deepcopy(cast(Any, model).peft_config[ADAPTER])
    if base is None:
        base = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    config.base_model_name_or_path = str(base)
    whole = dict(state) if state is not None else None
    adapter = get_peft_model_state_dict(model, state_dict=whole, adapter_name=ADAPTER)
    trained = [n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n]
    values = whole if whole is not None else dict(model.named_parameters())
    extra = {n: values[n].detach().cpu().contiguous() for n in trained}
    with atomic_dir(directory) as tmp:
        config.save_pretrained(str(tmp))
        tensors = {PEFT_PREFIX + k: v.detach().cpu().contiguous() for k, v in adapter.items()}
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        if extra:
            save_file(extra, str(tmp / TRAINED_BASE), metadata={"format": "pt"})
    return Path(directory)


def adapter_base(directory: str | os.PathLike[str]) -> str | None:
    """The ``base_model_name_or_path`` of a saved adapter (None: not an adapter)."""
    f = Path(directory) / ADAPTER_CONFIG
    if not f.is_file():
        return None
    return str(json.loads(f.read_text()).get("base_model_name_or_path") or "")


def load_adapter(
    model: nn.Module, directory: str | os.PathLike[str], base: str | os.PathLike[str]
) -> None:
    """Load an adapter written by :func:`save_adapter` into ``model``, which
    :func:`add_lora` gave the same adapter layout. Raises ``ValueError`` when the
    adapter was trained on another base checkpoint than ``base``, or its rank,
    alpha or modules differ from ``model``'s."""
    from peft import LoraConfig, set_peft_model_state_dict

    d = Path(directory)
    saved_base = adapter_base(d)
    if saved_base is None:
        raise ValueError(f"{str(d)!r} holds no {ADAPTER_CONFIG}: not a LoRA adapter")
    if not _same_path(saved_base, base):
        raise ValueError(
            f"the adapter in {str(d)!r} was trained on base model {saved_base!r}, but the "
            f"configured base is {str(base)!r}: set model.path to the adapter's base"
        )
    saved = LoraConfig.from_pretrained(str(d))
    ours: Any = cast(Any, model).peft_config[ADAPTER]
    for key in ("r", "lora_alpha"):
        if getattr(saved, key) != getattr(ours, key):
            raise ValueError(
                f"the adapter in {str(d)!r} has {key}={getattr(saved, key)}, the configured "
                f"LoRA has {getattr(ours, key)}"
            )
    theirs, mine = _targets(saved.target_modules), _targets(ours.target_modules)
    if theirs != mine:
        raise ValueError(
            f"the adapter in {str(d)!r} adapts other modules than the configured LoRA "
            f"({sorted(theirs)} against {sorted(mine)})"
        )
    state = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(d / ADAPTER_WEIGHTS)).items()}
    result: Any = set_peft_model_state_dict(model, state, ADAPTER)
    if result.unexpected_keys:
        unknown = result.unexpected_keys[:3]
        raise ValueError(f"the adapter in {str(d)!r} has unknown tensors {unknown}")
    if (d / TRAINED_BASE).is_file():
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in load_file(str(d / TRAINED_BASE)).items():
                params[name].copy_(t)


def _targets(modules: list[str] | set[str] | str | None) -> set[str]:
    """A LoRA config's target modules as a set (peft keeps a list, a set or one regex)."""
    if modules is None:
        return set()
    return {modules} if isinstance(modules, str) else set(modules)


def _same_path(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return str(a) == str(b)


FUSED_GROUPS: tuple[frozenset[str], ...] = (
    frozenset({"q_proj", "k_proj", "v_proj"}),
    frozenset({"gate_proj", "up_proj"}),
)
"""Modules vLLM and SGLang load into one fused layer (``qkv_proj``, ``gate_up_proj``):
a reload must bring every part of a fused layer or none."""


@torch.no_grad()
def published_state(
    model: nn.Module, *, fused: bool = False, state: Mapping[str, torch.Tensor] | None = None
) -> Mapping[str, torch.Tensor]:
    """What an update sends the engines: the whole state dict, or for a LoRA
    model only its adapted modules' merged weights (:func:`merged_weights`).
    ``fused`` (a server that fuses projections): also the unadapted modules of
    each fused group with an adapted member (``k_proj`` beside adapted ``q_proj``
    and ``v_proj``), so every fused layer it reloads is whole. ``state``: compute
    it from this state dict of ``model`` (a sharded model's gathered one)."""
    if not has_lora(model):
        return model.state_dict() if state is None else state
    if state is not None:
        out = merged_from_state(model, state)
        state = {k.replace(".base_layer.", "."): v for k, v in state.items()}
    elif not fused:
        return MergedWeights(model)
    else:
        out = merged_weights(model)
        state = model.state_dict()
    if not fused:
        return out
    for key in list(out):
        prefix, leaf = key.removesuffix(".weight").rsplit(".", 1)
        group = next((g for g in FUSED_GROUPS if leaf in g), frozenset())
        for sibling in sorted(group - {leaf}):
            name = f"{prefix}.{sibling}.weight"
            if name not in out and name in state:
                out[name] = state[name]
    return out


def engine_model(model: nn.Module) -> nn.Module:
    """What the embedded engine copies its weights from: ``model``, or for a LoRA
    model a merged plain copy (the engine never runs adapters)."""
    return merged_copy(model) if has_lora(model) else model


def save_policy(model: nn.Module, directory: str | os.PathLike[str]) -> None:
    """A checkpoint's policy: ``save_pretrained``, or for a LoRA model its adapter."""
    if has_lora(model):
        save_adapter(model, directory)
    else:
        model.save_pretrained(directory)  # type: ignore[operator]


def export_policy(model: nn.Module, directory: Path) -> None:
    """A final policy into ``directory`` (being written): the full model, and for a
    LoRA model the merged model plus its adapter in ``adapter/``."""
    if has_lora(model):
        merged_copy(model).save_pretrained(directory)  # type: ignore[operator]
        save_adapter(model, directory / "adapter")
    else:
        model.save_pretrained(directory)  # type: ignore[operator]


def share_frozen_base(model: nn.Module, donor: nn.Module) -> int:
    """Point every frozen parameter of ``model`` at ``donor``'s frozen parameter of
    the same name (``base_layer`` aside), shape, dtype, device and value, so the two
    hold one copy: a LoRA critic's trunk and a LoRA actor's base, both the same
    checkpoint and both frozen for good. Returns the bytes no longer held twice.
    Parameters that train (adapters, the critic's final norm) stay its own."""

    def frozen(m: nn.Module) -> dict[str, tuple[nn.Module, str, nn.Parameter]]:
        out = {}
        for name, module in m.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    full = f"{name}.{pname}" if name else pname
                    out[full.replace(".base_layer.", ".")] = (module, pname, p)
        return out

    theirs = {k.removeprefix("model."): v[2] for k, v in frozen(donor).items()}
    saved = 0
    with torch.no_grad():
        for name, (module, pname, p) in frozen(model).items():
            q = theirs.get(name.removeprefix("model."))
            if (
                q is None
                or q is p
                or q.shape != p.shape
                or q.dtype != p.dtype
                or q.device != p.device
                or (p.device.type != "meta" and not torch.equal(q, p))  # (shells: same file)
            ):
                continue
            setattr(module, pname, q)
            saved += p.numel() * p.element_size()
    return saved
