"""Running an experiment: every run of its plan as a ``sao train`` subprocess,
``--jobs`` at a time, each in its own run directory, then the report.

Resumable: a run whose ``summary.json`` exists is kept (so is one carried from
another copy of the experiment, :mod:`sao.experiments.earlier`), a run directory with a
complete checkpoint is continued with ``sao train --resume RUN_DIR``, any other
is started afresh (a directory left by an attempt that stopped before its first
checkpoint is removed first). A run that finishes loses its ``checkpoints/``
(they exist to resume it; a SmolLM2 SAO run's last one, actor and critic with
their AdamW moments, is 2.9 GB) unless ``keep_checkpoints``; its ``final/``
model and its logs stay. Each attempt's exit status, wall-clock seconds and
code version (:func:`code_version`) are appended to
``RUN_DIR/experiment_attempts.jsonl``; its output goes to
``DIR/logs/ARM/seed-S.log``. Tiny warm-started policies the runs need are built
first, one process per policy, so that two runs never build the same one.

With ``--jobs N``, runs that would not fit in memory together do not run
together: each run says its expected peak once it has loaded its models, a run
started beside others learns what they will still claim, and one that fits
only alone waits for one of them to end (:func:`_pool`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sao.config import ConfigError, load_config
from sao.experiments.earlier import EARLIER_FILE, carry, earlier_runs
from sao.experiments.grid import Experiment, Run, claim_dir, plan
from sao.runtime.memory import (
    ESTIMATE_FILE_ENV,
    MEMORY_BUSY_EXIT,
    RESERVED_ENV,
    process_tree_rss,
)

Status = Literal["done", "resume", "fresh"]


def status(run: Run) -> Status:
    """``done`` (summary.json exists), ``resume`` (a complete checkpoint) or ``fresh``."""
    if (run.run_dir / "summary.json").is_file():
        return "done"
    from sao.rundir.checkpoint import latest_checkpoint

    return "resume" if latest_checkpoint(run.run_dir / "checkpoints") else "fresh"


def command(exp: Experiment, run: Run, how: Status) -> list[str]:
    """The ``sao train`` command line of ``run``."""
    train = [sys.executable, "-m", "sao.cli", "train"]
    if how == "resume":
        return [*train, "--resume", str(run.run_dir), "--set", "log.live=false"]
    sets = [*run.overrides, f"seed={run.seed}", f"log.run_dir={run.run_dir}", "log.live=false"]
    return [*train, "--preset", exp.preset, *(x for s in sets for x in ("--set", s))]


_WARM = (
    "import sys; from sao.config import load_config; from sao.app.parts import policy_path; "
    "policy_path(load_config(sys.argv[1], None, sys.argv[2:]))"
)


def warm_start_commands(exp: Experiment, runs: Sequence[Run]) -> list[list[str]]:
    """One command per distinct tiny warm-started policy the runs need and the
    cache lacks (each seed builds its own), so that concurrent runs never build
    the same one twice."""
    needed: dict[Path, list[str]] = {}
    for run in runs:
        sets = [*run.overrides, f"seed={run.seed}"]
        cfg = load_config(exp.preset, None, sets)
        if cfg.model.path is not None:
            continue
        from sao.app.warmstart import policy_dir

        options = {"seed": cfg.seed, **cfg.task.options}
        path = policy_dir(cfg.task.name, options, size=cfg.model.tiny_size, seed=cfg.seed)
        if not path.is_dir():
            needed.setdefault(path, [sys.executable, "-c", _WARM, exp.preset, *sets])
    return list(needed.values())


@dataclass(frozen=True)
class _Job:
    label: str
    cmd: list[str]
    log: Path
    done: Callable[[int, float], str] | None = None
    """Called with the exit status and seconds; returns a note for the progress line."""
    peak_file: Path | None = None
    """Where the job (a ``sao train`` run) writes its expected peak memory; None: a
    job that claims no reservation (its memory is whatever it holds)."""

    def finish(self, rc: int, seconds: float) -> str:
        return self.done(rc, seconds) if self.done is not None else ""


PEAK_WAIT_S = 600.0
"""How long a new job waits for a running one to say its expected peak (a run
built by older code never does); past that, the running one reserves nothing."""


def _reserved(running: Sequence[tuple[_Job, subprocess.Popen[bytes], float]]) -> int | None:
    """Host bytes the running jobs will still claim: each one's expected peak less
    what its processes hold now; None while one has not yet said its peak."""
    total = 0
    for job, proc, t0 in running:
        if job.peak_file is None:
            continue
        try:
            said = job.peak_file.read_text().strip()
        except FileNotFoundError:
            if time.perf_counter() - t0 < PEAK_WAIT_S:
                return None
            continue
        if said != "unknown":
            total += max(0, int(said) - sum(process_tree_rss(proc.pid)))
    return total


def _start(job: _Job, env: dict[str, str], reserved: int) -> subprocess.Popen[bytes]:
    """Start ``job``, its output appended to its log, told the ``reserved`` bytes
    the jobs beside it will still claim and where to say its own peak."""
    job.log.parent.mkdir(parents=True, exist_ok=True)
    env = env | {RESERVED_ENV: str(reserved)}
    if job.peak_file is not None:
        job.peak_file.unlink(missing_ok=True)  # a former attempt's
        env[ESTIMATE_FILE_ENV] = str(job.peak_file)
    with job.log.open("a") as out:
        return subprocess.Popen(
            job.cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            # a shell's background jobs ignore SIGINT; the runs must not
            preexec_fn=_default_sigint,
        )


def _pool(jobs: Sequence[_Job], n: int, echo: Callable[[str], None]) -> list[str]:
    """Run ``jobs``, ``n`` at a time; returns the labels of those that failed.

    Beside running jobs, a job starts only once each of them has said its expected
    peak memory, and learns what they will still claim (``sao.runtime.memory``);
    one that fits alone but not beside them exits with ``MEMORY_BUSY_EXIT`` and
    goes back to the front of the queue, and no job starts until one ends.

    On an interrupt (Ctrl-C, or SIGTERM to this process) the running ones get
    SIGINT (a run stops as on Ctrl-C, keeping its last complete checkpoint), then
    SIGTERM after 30 s and SIGKILL 10 s later; checkpoints are written atomically,
    so none of these can leave a broken one."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    todo = list(jobs)
    running: list[tuple[_Job, subprocess.Popen[bytes], float]] = []
    failed: list[str] = []
    busy = False  # a job waits for memory: start none until a running one ends
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _sigterm) if main else None  # stop runs too
    try:
        while todo or running:
            while todo and len(running) < n and not busy:
                reserved = _reserved(running)
                if reserved is None:  # a running job has not said its peak yet
                    break
                job = todo.pop(0)
                running.append((job, _start(job, env, reserved), time.perf_counter()))
            time.sleep(0.2)
            for item in list(running):
                job, proc, t0 = item
                rc = proc.poll()
                if rc is None:
                    continue
                running.remove(item)
                if rc == MEMORY_BUSY_EXIT:
                    echo(f"{job.label}: waits for memory, until a run beside it ends")
                    todo.insert(0, job)
                    busy = bool(running)
                    continue
                busy = False
                seconds = time.perf_counter() - t0
                note = job.finish(rc, seconds)
                verdict = "done" if rc == 0 else f"FAILED (exit {rc}, log {job.log})"
                echo(f"{job.label}: {verdict} in {seconds / 60:.1f} min{note}")
                if rc != 0:
                    failed.append(job.label)
    except BaseException:
        _stop([proc for _, proc, _ in running])
        for job, proc, t0 in running:
            job.finish(proc.wait(), time.perf_counter() - t0)
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    return failed


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGINT, then SIGTERM after 30 s, then SIGKILL after 10 more."""
    for sig, wait_s in ((signal.SIGINT, 30.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            p.send_signal(sig)
        deadline = time.monotonic() + (wait_s or 0.0)
        while wait_s is not None and any(p.poll() is None for p in alive):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)


def code_version() -> str:
    """``sao X.Y.Z``, and when the imported package sits in a git checkout (the
    runs import the same one) ``+ git COMMIT``, ``-dirty`` if it has uncommitted
    changes: a run whose attempts ran different code says so in the report."""
    import sao

    version = f"sao {sao.__version__}"
    package = Path(sao.__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", *args], cwd=package, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or (Path(top) / "sao").resolve() != package:
        return version
    commit = git("describe", "--always", "--dirty", "--abbrev=12")
    return f"{version} + git {commit}" if commit else version


def _attempt_recorder(
    run: Run, how: Status, code: str, keep_checkpoints: bool = False
) -> Callable[[int, float], str]:
    """Appends the attempt to ``RUN_DIR/experiment_attempts.jsonl`` (the report's
    wall time sums them), removes a finished run's checkpoints unless
    ``keep_checkpoints``, and returns the run's held-out success for the log line."""

    def done(rc: int, seconds: float) -> str:
        if not run.run_dir.is_dir():
            return ""
        line = {"how": how, "rc": rc, "wall_s": round(seconds, 1), "code": code}
        with (run.run_dir / "experiment_attempts.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")
        summary = run.run_dir / "summary.json"
        if rc != 0 or not summary.is_file():
            return ""
        if not keep_checkpoints:
            shutil.rmtree(run.run_dir / "checkpoints", ignore_errors=True)
        s = json.loads(summary.read_text())
        return f", held-out success {s['eval/success_first']:.3f} -> {s['eval/success_last']:.3f}"

    return done


def _elsewhere(
    exp: Experiment,
    exp_dir: Path,
    runs: Sequence[Run],
    earlier: Path | None,
    overrides: Sequence[str],
    echo: Callable[[str], None],
) -> list[Run]:
    """Carry ``earlier``'s runs in (when given); the runs of ``runs`` finished
    elsewhere, carried now or before, with no directory of their own here."""
    if earlier is not None:
        got = carry(exp, exp_dir, earlier, overrides)
        echo(f"carried {len(got)} finished runs from {earlier} into {exp_dir / EARLIER_FILE}")
    carried = {(r.arm, r.seed) for r in earlier_runs(exp_dir)}
    return [r for r in runs if (r.arm, r.seed) in carried and not r.run_dir.exists()]


def run_experiment(
    exp: Experiment,
    exp_dir: Path,
    *,
    seeds: int = 3,
    jobs: int = 1,
    overrides: Sequence[str] = (),
    arms: Sequence[str] | None = None,
    keep_checkpoints: bool = False,
    earlier: Path | None = None,
    echo: Callable[[str], None] = print,
) -> list[str]:
    """Run (or resume) every run of ``exp`` in ``exp_dir``, ``jobs`` at a time,
    then write the report; returns the labels of runs that failed. A run that
    finishes loses its checkpoints unless ``keep_checkpoints``. ``earlier``: a
    report directory whose runs are carried in first (:func:`carry`); a run
    carried, now or before, is not run again unless ``exp_dir`` has a directory
    for it."""
    if jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    runs = plan(exp, exp_dir, seeds=seeds, overrides=overrides, arms=arms)
    claim_dir(exp, exp_dir, overrides)
    elsewhere = _elsewhere(exp, exp_dir, runs, earlier, overrides, echo)
    todo = [(run, how) for run in runs if run not in elsewhere and (how := status(run)) != "done"]
    warm = warm_start_commands(exp, [run for run, _ in todo])
    if warm:
        echo(f"building {len(warm)} warm-started policies first (once; then cached)")
        logs = exp_dir.resolve() / "logs"
        bad = _pool(
            [_Job(f"warm start {i}", c, logs / f"warm-start-{i}.log") for i, c in enumerate(warm)],
            jobs,
            echo,
        )
        if bad:  # each run then builds (or fails on) its own; its log says why
            echo(f"building a warm-started policy failed; see {logs}/warm-start-*.log")
    pending: list[_Job] = []
    code = code_version()
    for run, how in todo:
        if how == "fresh" and run.run_dir.exists():
            shutil.rmtree(run.run_dir)  # an attempt that stopped before its first checkpoint
        label = f"{run.label} ({'resumed' if how == 'resume' else 'started'})"
        done = _attempt_recorder(run, how, code, keep_checkpoints)
        peak = run.log.with_suffix(".peak")
        pending.append(_Job(label, command(exp, run, how), run.log, done, peak))
    kept = len(runs) - len(pending)
    there = f" ({len(elsewhere)} of them elsewhere, carried)" if elsewhere else ""
    echo(
        f"experiment {exp.name}: {len(runs)} runs, {kept} already finished{there}, "
        f"{len(pending)} to run, {jobs} at a time, in {exp_dir}"
    )
    failed = _pool(pending, jobs, echo)
    from sao.experiments.report import write_report

    written = write_report(exp_dir)
    plots = sum(p.suffix == ".png" for p in written)
    echo(f"report: {', '.join(str(p) for p in written[:2])} and {plots} plots")
    from sao.experiments.claims import verdicts_md

    echo("\n".join(["", *verdicts_md([exp_dir])]))
    return failed
