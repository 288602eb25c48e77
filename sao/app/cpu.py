"""What this CPU can do that a run's speed depends on: its model and the
instruction sets its matrix products use, and the warning a bfloat16 run gets
on a CPU without bfloat16 arithmetic."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

__all__ = ["bfloat16_warning", "cpu_flags", "cpu_model"]

GEMM_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The flags that decide how fast this CPU multiplies float32 and bfloat16 matrices."""
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, frozenset[str]]:
    """The CPU's model name and flags (no flags where ``cpuinfo`` is absent)."""
    name, flags = platform.processor() or "unknown CPU", frozenset[str]()
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return name, flags
    for line in lines:
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            flags = frozenset(line.split(":", 1)[1].split())
    return name, flags


def cpu_model() -> str:
    """The CPU's model name and which of :data:`GEMM_FLAGS` it has."""
    name, flags = cpu_flags()
    return f"{name} ({', '.join(f for f in GEMM_FLAGS if f in flags)})"


def bfloat16_warning(
    device: torch.device, trainer: torch.dtype, engine: torch.dtype | None
) -> str | None:
    """A warning where a run computes in bfloat16 on a CPU without bfloat16
    arithmetic (neither avx512_bf16 nor AMX): its batched bfloat16 matrix
    products are then slower than float32 ones, not faster (None otherwise)."""
    uses = ["model.dtype"] if trainer == torch.bfloat16 else []  # (the engine's copy follows)
    uses += ["rollout.engine_dtype"] if engine == torch.bfloat16 and not uses else []
    name, flags = cpu_flags()
    if device.type != "cpu" or not uses or not flags or flags & BF16_FLAGS:
        return None
    return (
        f"warning: {' and '.join(uses)} bfloat16 on a CPU without bfloat16 arithmetic "
        f"({name}: neither avx512_bf16 nor amx_bf16), where batched bfloat16 matrix "
        "products are slower than float32 ones (BENCHMARKS.md, 'bfloat16 on a CPU without "
        "it'); float32 is the faster choice here"
    )
