"""What the embedded engine knows of its own weights when an update arrives:
their names and shapes (an update naming another weight, or another shape, is
refused before anything is copied), which weights full updates have replaced,
and the base weights of LoRA-adapted modules, kept aside at the first adapter
update so that each later one merges onto the checkpoint's weight
(:class:`~sao.rollout.weights.MergedAdapter`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sao.rollout.weights import MergedAdapter

__all__ = ["WeightBook"]


class WeightBook:
    """The engine's named weights (its model's ``state_dict``, shared with the
    scheduler that copies updates into them) and their update history."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.weights = weights
        self._base: dict[str, torch.Tensor] = {}  # adapted modules' loaded weights (LoRA)
        self._replaced: set[str] = set()  # weights a full update has replaced

    def check(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Refuse a weight the model lacks or one of another shape. A lazy mapping
        (:class:`sao.models.lora.MergedWeights`) names its shapes, so that checking
        them does not compute each tensor a second time."""
        shapes = getattr(state_dict, "shapes", None)
        for name in state_dict:
            if name not in self.weights:
                raise KeyError(
                    f"load_weights: {name!r} is not a weight of the engine's model; "
                    "pass keys of model.state_dict()"
                )
            shape = tuple(shapes[name] if shapes is not None else state_dict[name].shape)
            if shape != tuple(self.weights[name].shape):
                raise ValueError(
                    f"load_weights: {name!r} has shape {shape}, "
                    f"the engine's model has {tuple(self.weights[name].shape)}"
                )

    def replaced(self, names: Mapping[str, torch.Tensor]) -> None:
        """Record a full update of ``names``: their base weights are gone."""
        self._replaced.update(names)

    def merged(
        self, tensors: Mapping[str, torch.Tensor], adapter: Mapping[str, Any]
    ) -> MergedAdapter:
        """The merged weights of an adapter update (``tensors``: ``<module>.lora_A``
        and ``<module>.lora_B``; ``adapter``: ``scaling`` by module and
        ``fan_in_fan_out``), each module's base kept aside the first time. A module
        whose weight a full update replaced has no base left: a ``ValueError``."""
        scaling = dict(adapter["scaling"])
        for module in scaling:
            key = f"{module}.weight"
            if key not in self.weights:
                raise KeyError(f"load_adapter: the engine's model has no module {module!r}")
            if module not in self._base:
                if key in self._replaced:
                    raise ValueError(
                        f"load_adapter: {module}'s weight was replaced since the engine loaded "
                        "its checkpoint, so its base weight is gone; restart the engine on the "
                        "base checkpoint"
                    )
                self._base[module] = self.weights[key].detach().clone()
        flip = bool(adapter.get("fan_in_fan_out", False))
        return MergedAdapter(self._base, tensors, scaling, flip)
