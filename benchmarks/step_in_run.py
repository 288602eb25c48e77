"""A trainer step inside a run, asynchronous against synchronous: what the engine's
decoding on the same cores costs the step, and each arm's step against GRPO's.

``benchmarks/trainer_step.py`` times a step with the cores to itself. In an
asynchronous run (``runtime.max_lag`` >= 1) the engine decodes the next batch
while the trainer steps, on the same cores; with ``runtime.max_lag=0`` (the
same code, synchronous) it waits for the new weights, so the step has the
cores to itself. Each arm of a named experiment (its base and arm overrides,
as ``sao experiment`` runs them, with ``--steps`` actor steps) runs twice as a
``sao train`` subprocess, one after the other: as the experiment sets it, and
with ``runtime.max_lag=0``. Figures are the runs' own metrics, medians over
the actor steps after the first: ``time/train_step_s``, of which
``time/critic_s`` (collating, the critic's forwards and K updates, the
advantages) and ``time/actor_s``; the batch's tokens (``train/tokens``: each
arm trains on its own episodes, so a step's cost follows its tokens); and
``idle/rollout_frac`` at the end.

    PYTHONPATH=. python benchmarks/step_in_run.py [--experiment smollm2-guess]
        [--arms sao_top1,sao,grpo] [--steps 5] [--seed 0] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._bench import QUIET
from sao.app.cpu import cpu_model
from sao.experiments.named import get_experiment

SYNC = "runtime.max_lag=0"
PASSES = ("time/train_step_s", "time/critic_s", "time/actor_s")


def overrides(experiment: str, arm: str, steps: int, seed: int, extra: list[str]) -> list[str]:
    """The arm's ``--set`` list as ``sao experiment`` builds it, with ``steps`` actor steps."""
    exp = get_experiment(experiment)
    sets = [s for s in (*exp.base, *exp.arms[arm]) if not s.startswith("train.steps=")]
    return [*sets, *extra, f"train.steps={steps}", f"seed={seed}", "eval.every=1000", *QUIET]


def run(preset: str, sets: list[str], run_dir: Path) -> list[dict[str, float]]:
    """One ``sao train``; its metrics rows."""
    cmd = [sys.executable, "-m", "sao.cli", "train", "--preset", preset]
    for s in [*sets, f"log.run_dir={run_dir}"]:
        cmd += ["--set", s]
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """Medians of the passes over the actor steps after the first, and the rollout idle share."""
    actor = [r for r in rows if "actor/loss" in r][1:]
    out = {k: statistics.median(r[k] for r in actor) for k in PASSES}
    out["tokens"] = statistics.median(r["train/tokens"] for r in actor)
    out["steps"] = len(actor)
    out["idle/rollout_frac"] = rows[-1]["idle/rollout_frac"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="smollm2-guess")
    ap.add_argument("--arms", default="sao_top1,sao,grpo", help="comma-separated; grpo last")
    ap.add_argument("--steps", type=int, default=5, help="actor steps (warm-up batches first)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
    args = ap.parse_args()
    exp = get_experiment(args.experiment)
    arms = args.arms.split(",")
    print(f"{exp.name} ({exp.preset}), {args.steps} actor steps, seed {args.seed}, "
          f"--set {args.set}; CPU: {cpu_model()}")  # fmt: skip
    res: dict[tuple[str, str], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in arms:
            base = overrides(exp.name, arm, args.steps, args.seed, args.set)
            for mode, more in (("async", []), ("sync", [SYNC])):
                rows = run(exp.preset, [*base, *more], Path(tmp) / f"{arm}-{mode}")
                res[arm, mode] = medians(rows)
                print(f"  {arm} {mode}: {res[arm, mode]}", flush=True)
    ref = arms[-1]
    print(f"\nmedian seconds over actor steps 2-{args.steps}; ratio: step / {ref}'s step")
    print("| arm | mode | tokens | step s | critic s | actor s | rest s | rollout idle | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (arm, mode), m in res.items():
        step, critic, actor = (m[k] for k in PASSES)
        ratio = step / res[ref, mode]["time/train_step_s"]
        cells = (step, critic, actor, step - critic - actor, m["idle/rollout_frac"], ratio)
        line = f"| {arm} | {mode} | {m['tokens']:.0f} | "
        print(line + " | ".join(f"{c:.2f}" for c in cells) + " |")
    for arm in arms:
        slow = res[arm, "async"]["time/train_step_s"] / res[arm, "sync"]["time/train_step_s"]
        print(f"{arm}: the asynchronous run's step is {slow:.2f}x the synchronous run's")


if __name__ == "__main__":
    main()
