"""Asynchrony on long-tailed generation: SAO asynchronous vs GRPO synchronous.

The tail agentic RL has is in generation, not only in tool latency: a few
episodes run many more turns (and tokens) than the median. Here the
calculator task's tool is *busy* a heavy-tailed number of times per episode:
episode k draws ``r`` from a Pareto law (``floor(U ** (-1 / alpha))``,
``alpha`` 1.1: half the episodes get no retry, ~8% ten or more), clipped to
``--max-retries``, and the tool answers ``error: busy, call again`` to that
many replies before the episode goes on as usual. A tail episode so
generates 10-30x the median's tokens over as many turns. No sleeping: every
second is generation or training.

Three arms (:data:`ARMS`) train the same number of trajectories (steps x
batch) in one process, one after the other (order reversed every other round). Prints, per arm,
wall-clock time, trajectories/s, trainer idle fraction, mean staleness, the
median trainer step time, the
per-episode turn and character distribution (the calculator's tiny
policy is character-level: a character is a token), and the wall-clock
ratios to SAO asynchronous; with
``--project``, the cluster projection of docs/scaling.md from the measured
per-episode traces (``benchmarks/longtail_model.py``).

    python benchmarks/longtail.py [--steps 12] [--batch 32] [--rounds 1]
        [--alpha 1.1] [--max-retries 30] [--project]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench import QUIET
from longtail_model import Trace, project

from sao.app.parts import policy_path
from sao.app.run import train
from sao.config import load_config
from sao.envs.base import Env, Observation, Split, StepResult, Task
from sao.envs.registry import make_task

BUSY = "error: busy, call again"


class BusyEnv:
    """A calculator episode whose tool is busy for its first ``retries`` calls;
    appends its :class:`Trace` (reset to score) to ``traces`` when scored."""

    def __init__(self, inner: Env, retries: int, traces: list[Trace] | None) -> None:
        self.inner, self.retries, self.traces = inner, retries, traces
        self.turns = self.chars = 0
        self.start = time.perf_counter()

    async def reset(self, seed: int) -> Observation:
        self.start = time.perf_counter()
        return await self.inner.reset(seed)

    async def step(self, action: str) -> StepResult:
        self.turns += 1
        self.chars += len(action) + 1  # + the end-of-turn token
        if self.retries > 0:  # whatever the reply: the tool is busy
            self.retries -= 1
            return StepResult(BUSY, done=False, info={"busy": 1})
        return await self.inner.step(action)

    def score(self) -> float:
        if self.traces is not None:
            self.traces.append(Trace(time.perf_counter() - self.start, self.turns, self.chars))
        return self.inner.score()


class BusyTask:
    """calc-tiny's task with heavy-tailed tool retries (see the module docstring)."""

    def __init__(self, inner: Task, *, alpha: float, max_retries: int, seed: int) -> None:
        self.inner, self.alpha, self.max_retries, self.seed = inner, alpha, max_retries, seed
        self.name = inner.name  # the tiny policy of the calculator task plays it
        self.traces: list[Trace] = []

    @property
    def eval_size(self) -> int:
        return self.inner.eval_size

    def retries(self, split: Split, index: int) -> int:
        """The draw for problem ``index`` (a pure function of it and the seed)."""
        u = random.Random(f"{self.seed}/{split}/{index}").random()
        return min(self.max_retries, math.floor((1.0 - u) ** (-1.0 / self.alpha)) - 1)

    def make_env(self, split: Split, index: int) -> Env:
        if split != "train":
            return BusyEnv(self.inner.make_env(split, index), 0, None)
        return BusyEnv(self.inner.make_env(split, index), self.retries(split, index), self.traces)

    def demonstrations(self, n: int, *, seed: int) -> list[Any]:
        return self.inner.demonstrations(n, seed=seed)


ARMS = {
    "sao_async": ["algo=sao", "algo.critic_pretrain_steps=0", "runtime.max_lag=4"],
    "sao_sync": ["algo=sao", "algo.critic_pretrain_steps=0", "runtime.max_lag=0"],
    "grpo_sync": ["algo=grpo", "algo.group_size=8", "runtime.max_lag=0"],
}
"""SAO asynchronous; the same SAO synchronous (the trainer's cost held equal, so the
ratio is asynchrony's alone); GRPO synchronous (the issue's comparison: a group
baseline trains no critic, so its steps are cheaper)."""


def run(name: str, task: BusyTask, overrides: list[str], out: Path) -> dict[str, Any]:
    """Train once; wall time, last-step runtime metrics, and the episode traces."""
    cfg = load_config(preset="calc-tiny", overrides=[*overrides, f"log.run_dir={out / name}"])
    task.traces = []
    t0 = time.perf_counter()
    run_dir = train(cfg, task=task)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "staleness/mean" in r]
    return {
        "wall_s": steps[-1]["wall_s"],
        "process_s": wall,
        "trajectories_per_s": steps[-1]["throughput/trajectories_per_s"],
        "trainer_idle": steps[-1]["idle/trainer_frac"],
        "staleness": statistics.fmean(r["staleness/mean"] for r in steps),
        "train_step_s": statistics.median(r["time/train_step_s"] for r in steps),
        "traces": task.traces,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--alpha", type=float, default=1.1)
    ap.add_argument("--max-retries", type=int, default=30)
    ap.add_argument("--project", action="store_true")
    args = ap.parse_args()
    policy = policy_path(load_config(preset="calc-tiny"))  # calc-tiny's warm start (cached)
    common = [
        f"model.path={policy}",
        f"train.steps={args.steps}",
        f"train.batch_size={args.batch}",
        f"rollout.in_flight={2 * args.batch}",
        f"rollout.max_turns={args.max_retries + 6}",
        "rollout.max_total_tokens=1536",
        "eval.every=1000000",
        "eval.episodes=1",
        *QUIET,
    ]
    inner = make_task("calculator", min_ops=1, max_ops=2, ops_per_call=2, early_answer_rate=0.6)
    task = BusyTask(inner, alpha=args.alpha, max_retries=args.max_retries, seed=0)
    got: dict[str, list[dict[str, Any]]] = {a: [] for a in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            names = list(ARMS) if rnd % 2 == 0 else list(ARMS)[::-1]
            for name in names:
                r = run(f"{name}-{rnd}", task, [*common, *ARMS[name]], Path(tmp))
                got[name].append(r)
                print(f"{name:9s} round {rnd}: " + _fmt(r), flush=True)
    for name, rs in got.items():
        print(f"{name:9s} episodes: " + _dist([t for r in rs for t in r["traces"]]), flush=True)
    a = got["sao_async"]
    wall = {name: statistics.fmean(r["wall_s"] for r in rs) for name, rs in got.items()}
    print(
        f"same {args.steps * args.batch} trajectories a run, {args.rounds} round(s); tool busy "
        f"Pareto alpha {args.alpha}, at most {args.max_retries} retries; wall-clock ratios: "
        f"sao_sync / sao_async {wall['sao_sync'] / wall['sao_async']:.2f}x, "
        f"grpo_sync / sao_async {wall['grpo_sync'] / wall['sao_async']:.2f}x",
        flush=True,
    )
    if args.project:
        traces = [t for r in a for t in r["traces"]]
        step_s = statistics.fmean(r["train_step_s"] for r in a)
        for line in project(traces, batch=args.batch, train_step_s=step_s):
            print(line, flush=True)


def _fmt(r: dict[str, Any]) -> str:
    return (
        f"wall {r['wall_s']:7.1f} s  {r['trajectories_per_s']:6.2f} traj/s  "
        f"trainer idle {r['trainer_idle']:.2f}  staleness {r['staleness']:.2f}  "
        f"train step {r['train_step_s']:.2f} s"
    )


def _dist(traces: list[Trace]) -> str:
    if not traces:
        return "(no traces)"
    tok = sorted(t.tokens for t in traces)
    turns = sorted(t.turns for t in traces)
    med = statistics.median(tok)
    q = tok[int(0.99 * (len(tok) - 1))]
    return (
        f"{len(traces)}; action tokens median {med:.0f}, p99 {q}, max {tok[-1]} "
        f"({tok[-1] / max(med, 1):.0f}x the median); turns median "
        f"{statistics.median(turns):.0f}, max {turns[-1]}"
    )


if __name__ == "__main__":
    main()
