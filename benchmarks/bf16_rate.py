"""float32 against bfloat16 matrix products on this CPU, at the shapes a run
multiplies: a large square product, a training micro-batch through an MLP
projection of SmolLM2-135M (hidden 576, intermediate 1536), and decoding at
batch 32 and batch 1 through the same projection. Each shape alternates the
two dtypes for ``--rounds`` rounds (best of each, GFLOP/s); the ratio is
bfloat16's rate over float32's. Without avx512_bf16 or AMX, torch has no
bfloat16 arithmetic to use.

    PYTHONPATH=. python benchmarks/bf16_rate.py [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import sao  # noqa: F401  (before torch: sao's OpenMP defaults, as in `sao`)

# isort: split
import argparse
import os
import time

import torch

from sao.app.cpu import cpu_model

SHAPES = {  # name: (M, K, N)
    "square 2048": (2048, 2048, 2048),
    "train 16 x 256 tokens": (4096, 576, 1536),
    "decode batch 32": (32, 576, 1536),
    "decode batch 1": (1, 576, 1536),
}


def rate(m: int, k: int, n: int, dtype: torch.dtype) -> float:
    """GFLOP/s of ``[m, k] @ [k, n]`` in ``dtype``, over enough repeats for ~0.2 s."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    torch.mm(a, b)
    reps, t = 1, 0.0
    while t < 0.2:
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        t = time.perf_counter() - t0
        reps *= 2
    return 2 * m * k * n * (reps // 2) / t / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} torch threads; CPU: {cpu_model()}")
    print("| product | M x K x N | float32 GFLOP/s | bfloat16 GFLOP/s | bfloat16 / float32 |")
    print("|---|---|---|---|---|")
    for name, (m, k, n) in SHAPES.items():
        best = {torch.float32: 0.0, torch.bfloat16: 0.0}
        for _ in range(args.rounds):
            for dtype in best:
                best[dtype] = max(best[dtype], rate(m, k, n, dtype))
        f32, bf16 = best.values()
        print(f"| {name} | {m} x {k} x {n} | {f32:.1f} | {bf16:.1f} | {bf16 / f32:.2f} |")


if __name__ == "__main__":
    main()
