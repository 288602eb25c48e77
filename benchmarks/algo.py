"""Speed of the algorithm layer on CPU at B=128, T=8192.

Times skip-observation GAE (with length-adaptive lambda), step-level GAE, and
forward + backward of the DIS and PPO-clip losses, each the median of a few
repeats, on random inputs with ~30% observation positions.

    python benchmarks/algo.py [--B 128] [--T 8192] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from sao.algo import dis_loss, gae, length_adaptive_lambda, ppo_clip_loss, step_level_gae


def timeit(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` in seconds (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--B", type=int, default=128)
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    B, T = args.B, args.T
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(B, T, generator=g) < 0.7
    rewards = torch.zeros(B, T)
    last = torch.where(mask, torch.arange(T), -1).max(dim=1).values
    rewards[torch.arange(B), last] = (torch.rand(B, generator=g) < 0.5).float()
    values = torch.randn(B, T, generator=g)
    turn_id = (torch.arange(T) // 64).expand(B, T).masked_fill(~mask, -1).contiguous()
    rollout = -torch.rand(B, T, generator=g) * 3
    logp0 = rollout + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    lam = length_adaptive_lambda(mask, alpha=1.5)

    def loss_step(loss_fn: Callable[..., tuple[torch.Tensor, object]]) -> Callable[[], None]:
        def run() -> None:
            logp = logp0.clone().requires_grad_(True)
            loss, _ = loss_fn(logp, rollout, adv, mask)
            loss.backward()

        return run

    rows = [
        ("gae (skip-obs, adaptive lambda)", lambda: gae(rewards, values, mask, lam=lam)),
        (
            "step_level_gae (128 turns/row)",
            lambda: step_level_gae(rewards, values, mask, turn_id, lam=0.95),
        ),
        ("dis_loss fwd+bwd", loss_step(dis_loss)),
        ("ppo_clip_loss fwd+bwd", loss_step(ppo_clip_loss)),
    ]
    print(f"B={B} T={T} threads={torch.get_num_threads()} torch={torch.__version__}")
    for name, fn in rows:
        s = timeit(fn, args.repeats)
        print(f"{name:34s} {s * 1e3:9.1f} ms   {B * T / s / 1e6:7.1f} M tokens/s")


if __name__ == "__main__":
    main()
