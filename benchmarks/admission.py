"""Just-in-time admission vs the static rule, side by side in one run.

Each task trains SAO asynchronously (``runtime.max_lag=4``) twice per round,
once with ``runtime.admission=static`` (episodes start as early as the bound
allows) and once with ``jit`` (as late as keeps the trainer fed), rounds
interleaved so machine load falls on both alike. Prints, per task and arm,
trajectories trained per second of wall-clock (the static rule also
generates up to ``max_lag + 1`` batches that are never trained when the run
ends, so generated trajectories/s would flatter it), the median trainer step
time (machine load shows here), trainer idle fraction, mean staleness over
the actor steps, and the held-out success after the same number of steps;
then jit/static ratios.

Tasks: ``calc`` (calc-tiny as is) and ``latency`` (calc-tiny behind a
heavy-tailed environment latency, as in ``async_vs_sync.py``).

    python benchmarks/admission.py [--steps 40] [--rounds 2] [--tasks calc,latency]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from _bench import QUIET

from sao.app.run import train
from sao.config import load_config

TASKS = {
    "calc": [],
    "latency": [
        "task.latency=lognormal",
        "task.latency_median_s=0.2",
        "task.latency_sigma=1.5",
        "task.latency_max_s=4",
        "rollout.step_timeout_s=30",
    ],
}


def run(overrides: list[str], out: Path, eval_episodes: int) -> dict[str, float]:
    """Train once; the run's throughput, idle, mean staleness and final held-out success."""
    more = [f"log.run_dir={out}", f"eval.episodes={eval_episodes}"]
    cfg = load_config(overrides=[*overrides, *more])
    run_dir = train(cfg)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "staleness/mean" in r]
    actor = [r for r in steps if "actor/grad_norm" in r]  # after the critic warm-up
    evals = [r["eval/success"] for r in rows if "eval/success" in r]
    trained = cfg.train.batch_size * len(steps)
    return {
        "trajectories_per_s": trained / steps[-1]["wall_s"],
        "train_step_s": statistics.median(r["time/train_step_s"] for r in actor),
        "trainer_idle": steps[-1]["idle/trainer_frac"],
        "staleness": statistics.fmean(r["staleness/mean"] for r in actor),
        "success": evals[-1],
        "wall_s": steps[-1]["wall_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tasks", default="calc,latency")
    ap.add_argument("--eval-episodes", type=int, default=200)
    args = ap.parse_args()
    common = [
        "algo=sao",
        "runtime.max_lag=4",
        f"train.steps={args.steps}",
        f"eval.every={args.steps}",
        *QUIET,
    ]
    arms = ("static", "jit")
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks.split(","):
            got: dict[str, list[dict[str, float]]] = {a: [] for a in arms}
            for rnd in range(args.rounds):
                for arm in arms if rnd % 2 == 0 else arms[::-1]:
                    extra = [*common, *TASKS[task], f"runtime.admission={arm}", f"seed={rnd}"]
                    r = run(extra, Path(tmp) / f"{task}-{arm}-{rnd}", args.eval_episodes)
                    got[arm].append(r)
                    print(f"{task:8s} {arm:6s} round {rnd}: " + _fmt(r), flush=True)
            mean = {a: {k: statistics.fmean(r[k] for r in got[a]) for k in got[a][0]} for a in arms}
            for a in arms:
                print(f"{task:8s} {a:6s} mean of {args.rounds}: " + _fmt(mean[a]), flush=True)
            s, j = mean["static"], mean["jit"]
            speed = j["trajectories_per_s"] / s["trajectories_per_s"]
            print(
                f"{task:8s} jit/static: trained trajectories/s {speed:.2f}x, "
                f"trainer idle {100 * (j['trainer_idle'] - s['trainer_idle']):+.1f} points, "
                f"staleness {j['staleness'] / max(s['staleness'], 1e-9):.2f}x "
                f"({s['staleness']:.2f} -> {j['staleness']:.2f}), held-out success "
                f"{s['success']:.3f} -> {j['success']:.3f} after {args.steps} steps",
                flush=True,
            )


def _fmt(r: dict[str, float]) -> str:
    return (
        f"{r['trajectories_per_s']:6.2f} trained traj/s  step {r['train_step_s']:.2f} s  "
        f"trainer idle {r['trainer_idle']:.3f}  "
        f"staleness {r['staleness']:.2f}  held-out {r['success']:.3f}  wall {r['wall_s']:.0f} s"
    )


if __name__ == "__main__":
    main()
