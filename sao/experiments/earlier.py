"""Runs an experiment carries from another copy of it: a grid that outlives the
machine it ran on.

Every report writes ``runs.jsonl`` beside ``results.csv``: each reported run's
numbers and curves, one JSON object a line. ``sao experiment NAME --dir DIR
--earlier SRC`` reads the runs of another report directory ``SRC`` (its
``runs.jsonl``; a report older than that file has only ``results.csv``, whose
rows give numbers without curves) into ``DIR/earlier.jsonl``, after checking
that ``SRC`` holds the same experiment with runs made the same way (preset,
base, overrides, each arm both define). A run carried so is finished: it is
not run again while ``DIR`` has no directory of its own for it, and the report
counts it, its curves in the plots where they were carried, and says which
runs came from elsewhere. A run directory in ``DIR`` takes precedence over a
carried run of the same arm and seed.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

from sao.config import ConfigError
from sao.experiments.grid import Experiment, load_meta, made_otherwise
from sao.experiments.results import RunResult

RUNS_FILE = "runs.jsonl"
EARLIER_FILE = "earlier.jsonl"


def run_json(run: RunResult) -> str:
    """One line of ``runs.jsonl``."""
    return json.dumps(asdict(run), sort_keys=True)


def run_of(line: str) -> RunResult:
    """The :class:`RunResult` of a ``runs.jsonl`` line."""
    d = json.loads(line)
    d["curves"] = {k: [(int(s), float(v)) for s, v in pts] for k, pts in d["curves"].items()}
    d["code"] = tuple(d["code"])
    return RunResult(**d)


def runs_of_csv(text: str) -> list[RunResult]:
    """The runs of a ``results.csv`` (numbers only: no curves, no code versions;
    the warm-up from ``trajectories / trajectories_per_step - actor_steps``)."""

    def num(x: str) -> float:
        return float(x) if x else float("nan")

    out = []
    for r in csv.DictReader(io.StringIO(text)):
        steps, per_step = int(r["actor_steps"]), int(r["trajectories_per_step"])
        out.append(
            RunResult(
                arm=r["arm"],
                seed=int(r["seed"]),
                actor_steps=steps,
                batch_size=per_step,
                warmup_steps=int(r["trajectories"]) // per_step - steps,
                initial_success=num(r["initial_success"]),
                final_success=num(r["final_success"]),
                best_success=num(r["best_success"]),
                final_reward=num(r["final_reward"]),
                collapse_step=int(r["collapse_step"]) if r["collapse_step"] else None,
                wall_s=float(r["wall_s"]),
            )
        )
    return out


def write_runs(path: Path, runs: Iterable[RunResult]) -> None:
    """``runs`` as ``runs.jsonl`` lines (written then renamed)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(run_json(r) + "\n" for r in runs))
    tmp.replace(path)


def read_runs(path: Path) -> list[RunResult]:
    """The runs of a ``runs.jsonl`` file ([] when there is none)."""
    if not path.is_file():
        return []
    return [run_of(x) for x in path.read_text().splitlines() if x.strip()]


def earlier_runs(exp_dir: Path) -> list[RunResult]:
    """The runs ``exp_dir`` carries from elsewhere (its ``earlier.jsonl``)."""
    return read_runs(exp_dir / EARLIER_FILE)


def carry(exp: Experiment, exp_dir: Path, src: Path, overrides: Sequence[str]) -> list[RunResult]:
    """Read the runs of the report directory ``src`` into ``exp_dir/earlier.jsonl``
    (replacing any carried before with the same arm and seed); returns them.
    Errors: ``src`` holds no experiment, another one, or runs made otherwise; it
    has no runs; its runs carry no curves while the experiment has switches
    (their recovery steps are read from the curves)."""
    meta = load_meta(src)
    if meta.get("name") != exp.name:
        raise ConfigError(
            f"--earlier {str(src)!r} holds experiment {meta.get('name')!r}, not {exp.name!r}"
        )
    if what := made_otherwise(meta, exp, overrides):
        raise ConfigError(
            f"--earlier {str(src)!r}: its runs were made with another {', '.join(what)} "
            f"(overrides there: {meta.get('overrides')}); they would not be comparable"
        )
    if (src / RUNS_FILE).is_file():
        runs = read_runs(src / RUNS_FILE)
    elif (src / "results.csv").is_file():
        runs = runs_of_csv((src / "results.csv").read_text())
        if exp.marks:
            raise ConfigError(
                f"--earlier {str(src)!r} has no {RUNS_FILE}, only results.csv: its runs "
                "carry no curves, and this experiment's recovery steps are read from them"
            )
    else:
        runs = []
    if not runs:
        raise ConfigError(f"--earlier {str(src)!r} holds no finished runs")
    new = {(r.arm, r.seed) for r in runs}
    kept = [r for r in earlier_runs(exp_dir) if (r.arm, r.seed) not in new]
    write_runs(exp_dir / EARLIER_FILE, [*kept, *runs])
    return runs


def carried_md(carried: Sequence[RunResult]) -> list[str]:
    """The report's line on runs carried from another copy ([] if none)."""
    if not carried:
        return []

    def which(runs: Sequence[RunResult]) -> str:
        arms = dict.fromkeys(r.arm for r in runs)
        return "; ".join(
            f"`{a}` seed{'s' * (sum(r.arm == a for r in runs) > 1)} "
            + ", ".join(str(r.seed) for r in runs if r.arm == a)
            for a in arms
        )

    bare = [r for r in carried if not r.curves]
    text = (
        f"Carried from another copy of this experiment ({EARLIER_FILE}; no run directory "
        f"here): {which(carried)}."
    )
    only = "Numbers only (read from a results.csv: no curves, staleness or code version)"
    if len(bare) == len(carried):
        text += f" {only}, absent from the plots."
    elif bare:
        text += f" {only}, absent from the plots: {which(bare)}."
    return ["", text]
