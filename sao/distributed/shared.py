"""A weight update through Ray's object store without a private copy in each
worker: the state dict as numpy byte arrays, which Ray maps read-only from the
node's shared memory into every worker that resolves it (zero-copy
deserialisation). A state dict of torch tensors is unpickled instead into a copy
of the whole update in each worker's heap (0.61 GiB for SmolLM2-135M in float32,
measured with ``benchmarks/ray_worker_memory.py``), which the engine copies into
its own weights and then frees. Every dtype travels as its bytes (numpy has no
bfloat16)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["SharedState", "from_shared", "to_shared"]


@dataclass(frozen=True)
class SharedState:
    """A state dict as bytes: ``arrays[name]`` holds the tensor's bytes, rebuilt
    with ``dtypes[name]`` and ``shapes[name]``."""

    arrays: dict[str, np.ndarray]
    dtypes: dict[str, torch.dtype]
    shapes: dict[str, tuple[int, ...]]


def to_shared(state: Mapping[str, torch.Tensor]) -> SharedState:
    """``state`` as a :class:`SharedState`; a contiguous CPU tensor's array is a
    view of its memory (Ray copies it once, into the object store)."""
    arrays, dtypes, shapes = {}, {}, {}
    for name, t in state.items():
        flat = t.detach().cpu().contiguous().reshape(-1)
        arrays[name] = flat.view(torch.uint8).numpy()
        dtypes[name], shapes[name] = t.dtype, tuple(t.shape)
    return SharedState(arrays, dtypes, shapes)


def from_shared(weights: SharedState | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """Tensors over a :class:`SharedState`'s arrays, without copying them (read
    them only: the object store's pages are read-only); a state dict of tensors
    is returned as it is."""
    if not isinstance(weights, SharedState):
        return weights
    with warnings.catch_warnings():  # torch warns that the arrays are not writable
        warnings.simplefilter("ignore", UserWarning)
        return {
            name: _tensor(a, weights.dtypes[name], weights.shapes[name])
            for name, a in weights.arrays.items()
        }


def _tensor(array: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if array.size == 0:  # (no element: torch cannot view an empty byte array as another dtype)
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(array).view(dtype).reshape(shape)
