"""Local vs Ray backend on this machine: the same `sao train` run (calc-tiny,
SAO) in one process, and with rollouts in Ray rollout-worker actors and the
trainer in one or two FSDP2 trainer-rank actors (or one for the actor and
one for the critic, ``runtime.critic_ranks=1``), side by side in one
invocation. Prints trajectories/s, the trainer's
step time and the weight-publish time per step (means over the actor steps
after the first 5), and the Ray/local ratios.

    PYTHONPATH=. python benchmarks/scale.py [--steps 30] [--workers 2]

On a GPU machine, ``--gpu`` runs the embedded engine and the trainer on CUDA
(bf16), one arm per rollout-worker count in ``--gpu-workers`` (default 1 2 4
8, each worker one GPU), and prints sampled tokens/s per GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run(args: argparse.Namespace, name: str, extra: list[str], root: Path) -> dict[str, float]:
    run_dir = root / name
    sets = [
        "log.live=false",
        "log.plots=false",
        "log.tensorboard=false",
        f"log.run_dir={run_dir}",
        f"train.steps={args.steps}",
        "algo.critic_pretrain_steps=0",
        f"eval.every={args.steps}",
        "eval.episodes=20",
        f"log.checkpoint_every={args.steps}",
        *extra,
    ]
    cmd = [sys.executable, "-m", "sao.cli", "train", "--preset", "calc-tiny"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/train_step_s" in r][5:]

    def mean(k: str) -> float:
        vals = [r[k] for r in steps if k in r]
        return sum(vals) / max(len(vals), 1)

    last = rows[-1]
    return {
        "trajectories_per_s": last["throughput/trajectories_per_s"],
        "tokens_per_s": last["throughput/tokens_per_s"],
        "train_step_s": mean("time/train_step_s"),
        "publish_s": mean("publish/sync_s"),
        "trainer_idle": last["idle/trainer_frac"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--gpu-workers", type=int, nargs="*", default=[1, 2, 4, 8])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.gpu:
            for n in args.gpu_workers:
                ray = [f"runtime.rollout_workers={n}", "runtime.gpus_per_worker=1"]
                r = run(args, f"gpu{n}", ["runtime.backend=ray", "model.device=cuda", *ray], root)
                print(f"{n} GPU(s): {r['tokens_per_s'] / n:.0f} tokens/s per GPU")
            return
        ray = ["runtime.backend=ray", f"runtime.rollout_workers={args.workers}"]
        results = {
            "local": run(args, "local", [], root),
            f"ray {args.workers}w 1 rank": run(args, "ray1", ray, root),
            f"ray {args.workers}w 2 ranks": run(
                args, "ray2", [*ray, "runtime.trainer_ranks=2"], root
            ),
            f"ray {args.workers}w 1 rank + 1 critic": run(
                args, "ray1c1", [*ray, "runtime.critic_ranks=1"], root
            ),
        }
    base = results["local"]
    print(f"calc-tiny, SAO, {args.steps} actor steps; means over steps 6..{args.steps}")
    head = ("backend", "traj/s", "ratio", "step s", "publish s", "trainer idle")
    print(f"{head[0]:<26}" + "".join(f"{h:>13}" for h in head[1:]))
    for name, r in results.items():
        cells = (
            f"{r['trajectories_per_s']:.1f}",
            f"{r['trajectories_per_s'] / base['trajectories_per_s']:.2f}",
            f"{r['train_step_s']:.3f}",
            f"{r['publish_s']:.4f}",
            f"{r['trainer_idle']:.2f}",
        )
        print(f"{name:<26}" + "".join(f"{c:>13}" for c in cells))


if __name__ == "__main__":
    main()
