"""Chaos test of checkpoints and resume: a tiny calc-tiny run (a random 0.1m
policy, a few steps, a checkpoint every two) is killed with SIGKILL at random
points, each aimed at one phase in turn (start-up, a training step, a
checkpoint write, an evaluation, the final export), and resumed with
``sao train --resume`` each time until it finishes. Then, from the run's
ledger (``log.ledger``, see :mod:`sao.rundir.ledger`) and its logs, it checks
that no trajectory was trained twice and none that finished before a
checkpoint was lost, that every step was logged once with its wall-clock
time and counters continuing, and that the run finished whole.

    python scripts/chaos.py --kills 20 --seed 0

Prints one line per attempt, then the result; exits 1 when an invariant broke.
Each attempt is a process forked from a server that has imported sao once
(``--start-method spawn``: a fresh interpreter each time, slower). The phase
an attempt is in is only observed from outside: the attempt marks it in a
file by wrapping ``sao.app.run``'s eval, checkpoint and finish functions.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PHASES = ("startup", "step", "checkpoint", "eval", "finish")
"""Kill targets: the first four in turn, then the last kill during the final
export. (The first kill, in the first start-up, leaves a run directory with
or without its config.yaml and no checkpoint: it starts over.)"""
DELAY_S = {"step": 0.3, "checkpoint": 0.01, "eval": 0.02, "finish": 0.01}
"""A kill aimed at a phase lands uniformly within this long after it begins."""


def settings(policy: Path, run_dir: Path, steps: int) -> list[str]:
    """``--set`` overrides of the smallest calc-tiny run that still has
    evaluations, checkpoints, pruning and a buffer carried across them."""
    return [
        f"model.path={policy}", f"log.run_dir={run_dir}", f"train.steps={steps}",
        "algo.critic_pretrain_steps=1", "train.batch_size=4", "rollout.in_flight=4",
        "rollout.max_turns=2", "rollout.max_new_tokens=16", "eval.episodes=4", "eval.every=2",
        "log.checkpoint_every=2", "log.keep_checkpoints=2", "log.ledger=true",
        "log.live=false", "log.tensorboard=false", "log.plots=false",
    ]  # fmt: skip


@dataclass
class Kill:
    attempt: int
    target: str
    phase: str
    """What the attempt was doing when the signal was sent."""
    after_s: float


@dataclass
class ChaosResult:
    kills: list[Kill] = field(default_factory=list)
    attempts: int = 0
    wall_s: float = 0.0
    steps: int = 0
    trained: int = 0
    resumed: int = 0
    """Attempts that continued from a checkpoint."""
    started_over: int = 0
    """Attempts that started the run over (killed before its first checkpoint)."""
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        phases = Counter(k.phase for k in self.kills)
        where = ", ".join(f"{p} {phases[p]}" for p in PHASES if phases[p])
        verdict = "OK" if not self.problems else "FAILED: " + "; ".join(self.problems)
        return (
            f"chaos: {len(self.kills)} SIGKILLs ({where}), {self.attempts} attempts "
            f"({self.resumed} resumed from a checkpoint, {self.started_over} started over), "
            f"{self.steps} steps, {self.trained} trajectories trained, "
            f"{self.wall_s:.0f} s: {verdict}"
        )


def chaos(
    work: Path,
    *,
    kills: int,
    seed: int = 0,
    steps: int = 8,
    start_method: str = "forkserver",
    timeout_s: float = 900.0,
    say: Any = print,
) -> ChaosResult:
    """Run the chaos test in ``work`` (a fresh directory); see the module docstring."""
    t0 = time.monotonic()
    rng = random.Random(seed)
    run_dir, logs, phase_file = work / "run", work / "logs", work / "phase"
    logs.mkdir(parents=True, exist_ok=True)
    policy = _policy(work / "policy")
    ctx: Any = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["sao.cli", "sao.app.run"])
    out = ChaosResult()
    startup_s = 0.6  # refined from the attempts seen
    while time.monotonic() - t0 < timeout_s:
        out.attempts += 1
        resume = (run_dir / "config.yaml").is_file()
        argv = ["train", "--resume", str(run_dir)] if resume else ["train", "--preset", "calc-tiny"]
        if not resume:
            argv += [x for s in settings(policy, run_dir, steps) for x in ("--set", s)]
        log = logs / f"attempt-{out.attempts:02d}.log"
        _set_phase(phase_file, "spawn")
        proc = ctx.Process(target=_child, args=(argv, str(log), str(phase_file)))
        started = time.monotonic()
        proc.start()
        target = _target(len(out.kills), kills)
        # kill i waits for step ~ (i + 1) / kills of the run: kills spread over all of it
        arm = (len(out.kills) + 1) * (steps + 1) // (kills + 1)
        killed, seen = _watch(
            proc, phase_file, run_dir / "metrics.jsonl", target, arm, rng, startup_s
        )
        proc.join()
        if seen is not None:
            startup_s = max(0.5, seen - started)
        if killed is not None:
            kill = Kill(out.attempts, str(target), killed, time.monotonic() - started)
            out.kills.append(kill)
            say(f"attempt {out.attempts}: killed during {killed} (aimed at {target})")
            continue
        say(f"attempt {out.attempts}: exited with {proc.exitcode}")
        if proc.exitcode != 0:
            tail = log.read_text()[-2000:] if log.is_file() else ""
            out.problems.append(f"attempt {out.attempts} exited with {proc.exitcode}: {tail}")
        break
    else:
        out.problems.append(f"the run did not finish within {timeout_s:.0f} s")
    out.problems += check_run(run_dir, out)
    said = "".join(p.read_text() for p in sorted(logs.glob("attempt-*.log")))
    out.resumed = said.count("resume: continuing ")
    out.started_over = said.count("starting it over from scratch")
    out.wall_s = time.monotonic() - t0
    return out


def _target(done: int, kills: int) -> str | None:
    if done >= kills:
        return None
    return "finish" if done == kills - 1 else PHASES[done % (len(PHASES) - 1)]


def _watch(
    proc: Any,
    phase_file: Path,
    metrics: Path,
    target: str | None,
    arm_step: int,
    rng: random.Random,
    startup_s: float,
) -> tuple[str | None, float | None]:
    """Wait for ``proc`` to exit, or kill it during ``target`` once it has
    logged step ``arm_step``. Returns the phase it was killed in (None: it
    exited) and when it left start-up."""
    start = time.monotonic()
    fire_at = start + rng.uniform(0.0, startup_s) if target == "startup" else None
    armed, left_startup, last, polls = False, None, "", 0
    while proc.is_alive():
        phase, now = _phase(phase_file), time.monotonic()
        if left_startup is None and phase not in ("spawn", "startup", ""):
            left_startup = now
        if not armed and polls % 5 == 0:
            armed = _logged_step(metrics) >= arm_step
        entered, last, polls = phase != last and phase == target, phase, polls + 1
        if fire_at is None and target is not None and armed and entered:
            fire_at = now + rng.uniform(0.0, DELAY_S[target])
        if fire_at is not None and now >= fire_at:
            phase = _phase(phase_file)
            os.kill(proc.pid, signal.SIGKILL)
            return phase or "startup", left_startup
        time.sleep(0.002)
    return None, left_startup


def _logged_step(metrics: Path) -> int:
    """The last step in ``metrics.jsonl`` (-1: none yet)."""
    try:
        lines = metrics.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)
        return int(json.loads(lines[-1])["step"])
    except (OSError, ValueError, KeyError):
        return -1


def _phase(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _set_phase(path: Path, phase: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(phase)
    os.replace(tmp, path)


def _child(argv: list[str], log: str, phase_file: str) -> None:
    """One attempt: ``sao`` with ``argv``, output to ``log``, phases marked."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import torch

    from sao.cli import main

    torch.set_num_threads(1)
    _mark_phases(Path(phase_file))
    try:
        code = main(argv)
    except BaseException as e:
        print(f"chaos: {type(e).__name__}: {e}", flush=True)
        code = 3
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _mark_phases(path: Path) -> None:
    """Wrap the run's phases so that each writes its name into ``path``."""
    import sao.app.run as run
    from sao.runtime.orchestrator import Orchestrator

    def wrap(fn: Any, phase: str, after: str | None) -> Any:
        async def marked(*args: Any, **kwargs: Any) -> Any:
            _set_phase(path, phase)
            try:
                return await fn(*args, **kwargs)
            finally:
                if after is not None:
                    _set_phase(path, after)

        return marked

    run._eval = wrap(run._eval, "eval", "step")
    run._checkpoint = wrap(run._checkpoint, "checkpoint", "step")
    run._finish = wrap(run._finish, "finish", None)
    Orchestrator.train = wrap(Orchestrator.train, "step", None)  # type: ignore[method-assign]
    _set_phase(path, "startup")


def _policy(path: Path) -> Path:
    """A random 0.1m policy over the default character tokenizer (no warm start:
    the test needs a run, not learning)."""
    if not (path / "config.json").is_file():
        from sao.models.tiny import build_tiny_policy
        from sao.models.tokenization import build_char_tokenizer

        tokenizer = build_char_tokenizer()
        build_tiny_policy(tokenizer, size="0.1m", seed=0).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def check_run(run_dir: Path, out: ChaosResult) -> list[str]:
    """The invariants of a finished run directory (fills ``out.steps``, ``out.trained``)."""
    from sao.rundir.ledger import LEDGER, check_ledger
    from sao.rundir.metrics import read_jsonl

    problems = []
    for name in ("summary.json", "final/config.json"):
        if not (run_dir / name).is_file():
            problems.append(f"the finished run has no {name}")
    ledger = check_ledger(run_dir / LEDGER, group_size=1)
    out.steps, out.trained = ledger.steps, ledger.trained
    problems += [f"ledger: {p}" for p in ledger.problems]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if [r["step"] for r in rows] != list(range(ledger.steps + 1)):
        problems.append(f"metrics.jsonl steps {[r['step'] for r in rows]}")
    for key in ("wall_s", "episodes/env_error", "episodes/timeout"):
        values = [r[key] for r in rows if key in r]
        if values != sorted(values):
            problems.append(f"{key} went back on resume: {values}")
    summary = json.loads((run_dir / "summary.json").read_text()) if not problems else {}
    if summary and summary["steps"] != ledger.steps:
        problems.append(f"summary.json says {summary['steps']} steps")
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    if len(kept) > 2:
        problems.append(f"more checkpoints kept than log.keep_checkpoints=2: {kept}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=40, help="actor steps of the run")
    ap.add_argument("--dir", help="work directory (default: a fresh temporary one)")
    ap.add_argument("--start-method", choices=["forkserver", "spawn"], default="forkserver")
    args = ap.parse_args(argv)
    import tempfile

    work = Path(args.dir or tempfile.mkdtemp(prefix="sao-chaos-"))
    result = chaos(
        work, kills=args.kills, seed=args.seed, steps=args.steps, start_method=args.start_method
    )
    print(result.summary())
    print(f"run directory: {work / 'run'}")
    return 0 if not result.problems else 1


if __name__ == "__main__":
    sys.exit(main())
