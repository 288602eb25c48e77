"""Where models live: ``model.device`` / ``model.dtype`` names -> torch objects.

One place decides the device and dtype of a run; everything else follows the
policy's parameters (``next(policy.parameters()).device``), so the same code
runs on CPU (tests) and on a GPU (bf16).

=========  ==============================================================
name       meaning
=========  ==============================================================
``auto``   ``cuda`` when a CUDA device is visible, else ``cpu``
``cpu``    the CPU
``cuda``   the current CUDA device; ``cuda:N`` the N-th visible one
=========  ==============================================================

dtype ``auto`` is bfloat16 on CUDA and float32 on CPU (bf16 matmuls on CPU are
slow and CPU tests compare log-probabilities at float32 precision).
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "DeviceError", "resolve_device", "resolve_dtype"]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtypes a run may train in, by config name."""


class DeviceError(ValueError):
    """A device or dtype the config asks for that this machine cannot give."""


def resolve_device(name: str) -> torch.device:
    """``"auto" | "cpu" | "cuda" | "cuda:N"`` -> a ``torch.device`` this machine has."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise DeviceError(
            f"model.device={name!r} is not a device sao trains on; use auto, cpu, cuda or cuda:N"
        )
    if device.type == "cpu":
        return torch.device("cpu")  # "cpu:0" and "cpu" are one device
    if not torch.cuda.is_available():
        raise DeviceError(
            f"model.device={name!r} but no CUDA device is visible (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda}); set model.device=cpu"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise DeviceError(
            f"model.device={name!r} but only {count} CUDA device(s) are visible "
            f"(cuda:0..cuda:{count - 1}); pick one of them or check CUDA_VISIBLE_DEVICES"
        )
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto" | "float32" | "bfloat16"`` -> a ``torch.dtype`` for ``device``."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise DeviceError(f"model.dtype={name!r} is not supported; use auto, float32 or bfloat16")
    dtype = DTYPES[name]
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError(
            f"model.dtype='bfloat16' but {torch.cuda.get_device_name(device)} has no bfloat16 "
            "support; set model.dtype=float32"
        )
    return dtype
