"""Asynchrony pays: SAO asynchronous vs synchronous GRPO, side by side.

Both train the calculator task's tiny policy behind a heavy-tailed latency
wrapper (every environment step sleeps a lognormal draw), on the same number
of trajectories. Synchronous GRPO (``runtime.max_lag=0``, groups of 8) waits
for the slowest episode of every batch before it trains, and generates nothing
while it trains; SAO keeps ``rollout.in_flight`` episodes running and trains
on whatever has finished. Prints wall-clock time, trajectories/s and trainer
idle fraction of each, and the wall-clock ratio.

    python benchmarks/async_vs_sync.py [--steps 12] [--batch 32]
        [--median 0.5] [--sigma 1.5] [--max 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from _bench import QUIET

from sao.app.run import train
from sao.config import load_config


def run(name: str, overrides: list[str], out: Path) -> dict[str, float]:
    """Train once; returns wall time and the last step's runtime metrics."""
    cfg = load_config(overrides=[*overrides, f"log.run_dir={out / name}"])
    t0 = time.perf_counter()
    run_dir = train(cfg)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "throughput/trajectories_per_s" in r][-1]
    return {
        "wall_s": wall,
        "train_s": last["wall_s"],
        "trajectories_per_s": last["throughput/trajectories_per_s"],
        "trainer_idle_frac": last["idle/trainer_frac"],
        "reward_last": last["train/reward_mean"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--median", type=float, default=0.5, help="median env-step latency, s")
    ap.add_argument("--sigma", type=float, default=1.5, help="lognormal sigma (tail weight)")
    ap.add_argument("--max", type=float, default=8.0, help="cap of one latency draw, s")
    args = ap.parse_args()
    common = [
        "task.latency=lognormal",
        f"task.latency_median_s={args.median}",
        f"task.latency_sigma={args.sigma}",
        f"task.latency_max_s={args.max}",
        f"train.steps={args.steps}",
        f"train.batch_size={args.batch}",
        "eval.every=1000000",
        "eval.episodes=1",
        *QUIET,
        "rollout.step_timeout_s=30",
    ]
    arms = {
        "sao_async": [
            "algo=sao",
            "algo.critic_pretrain_steps=0",
            "runtime.max_lag=4",
            f"rollout.in_flight={2 * args.batch}",
        ],
        "grpo_sync": [
            "algo=grpo",
            "algo.group_size=8",
            "runtime.max_lag=0",
            f"rollout.in_flight={args.batch}",
        ],
    }
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in arms.items():
            results[name] = run(name, [*common, *extra], Path(tmp))
            r = results[name]
            print(
                f"{name:10s} wall {r['train_s']:7.1f} s  {r['trajectories_per_s']:6.2f} traj/s  "
                f"trainer idle {r['trainer_idle_frac']:.2f}",
                flush=True,
            )
    ratio = results["grpo_sync"]["train_s"] / results["sao_async"]["train_s"]
    print(
        f"same {args.steps * args.batch} trajectories; latency lognormal median "
        f"{args.median}s sigma {args.sigma} cap {args.max}s: async is {ratio:.2f}x faster "
        "(wall-clock ratio)"
    )


if __name__ == "__main__":
    main()
