"""Runs carried from another copy of an experiment (``sao experiment --earlier``):
what they keep, when they are refused, and a report made of them alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sao.config import ConfigError
from sao.experiments.earlier import (
    EARLIER_FILE,
    RUNS_FILE,
    carry,
    earlier_runs,
    run_json,
    run_of,
    runs_of_csv,
    write_runs,
)
from sao.experiments.grid import Experiment, claim_dir
from sao.experiments.report import results_csv
from sao.experiments.results import RunResult
from sao.experiments.runner import run_experiment

EXP = Experiment(
    name="two",
    claim="SAO against GRPO.",
    preset="calc-tiny",
    arms={"sao": ("algo=sao",), "grpo": ("algo=grpo", "algo.group_size=4")},
    base=("train.steps=4",),
    claims=("sao > grpo",),
)


def _run(arm: str, seed: int, final: float, curves: bool = True) -> RunResult:
    evals = [(0, 0.25), (2, 0.5), (4, final)]
    return RunResult(
        arm, seed, 4, 16, 1 if arm == "sao" else 0, 0.25, final, max(final, 0.5), 0.4, None,
        61.5, {"eval/success": evals, "train/reward_mean": [(1, 0.3), (4, 0.4)]} if curves else {},
        ("sao 0.1.0 + git abc",) if curves else (),
    )  # fmt: skip


RUNS = [
    _run("sao", 0, 0.75), _run("sao", 1, 0.625), _run("sao", 2, 0.75),
    _run("grpo", 0, 0.5), _run("grpo", 1, 0.5), _run("grpo", 2, 0.625),
]  # fmt: skip


def _copy(path: Path, runs: list[RunResult], *, jsonl: bool = True, exp: Experiment = EXP) -> Path:
    """A report directory as another machine left it: no run directories."""
    claim_dir(exp, path, [])
    if jsonl:
        write_runs(path / RUNS_FILE, runs)
    (path / "results.csv").write_text(results_csv(runs))
    return path


def test_a_run_round_trips_through_its_line() -> None:
    for r in RUNS:
        assert run_of(run_json(r)) == r
    line = json.loads(run_json(RUNS[0]))
    assert line["curves"]["eval/success"] == [[0, 0.25], [2, 0.5], [4, 0.75]]


def test_results_csv_rows_give_numbers_and_the_warm_up() -> None:
    back = runs_of_csv(results_csv(RUNS))
    assert back == [_run(r.arm, r.seed, r.final_success, curves=False) for r in RUNS]
    # sao: (4 actor steps + 1 warm-up) x 16 = 80 trajectories -> warm-up 1
    assert [(r.arm, r.warmup_steps, r.trajectories) for r in back[::3]] == [
        ("sao", 1, 80),
        ("grpo", 0, 64),
    ]


def test_a_report_of_carried_runs_alone(tmp_path: Path) -> None:
    src = _copy(tmp_path / "copy", RUNS)
    said: list[str] = []
    dst = tmp_path / "here"
    assert run_experiment(EXP, dst, seeds=3, earlier=src, echo=said.append) == []
    assert said[0] == f"carried 6 finished runs from {src} into {dst / EARLIER_FILE}"
    assert said[1].startswith("experiment two: 6 runs, 6 already finished (6 of them elsewhere")
    assert "0 to run" in said[1]
    assert (dst / "results.csv").read_text() == results_csv(RUNS)
    assert (dst / RUNS_FILE).read_bytes() == (src / RUNS_FILE).read_bytes()
    assert (dst / "eval_success.png").is_file()
    md = (dst / "results.md").read_text()
    assert "`sao` seeds 0, 1, 2; `grpo` seeds 0, 1, 2." in md and "Numbers only" not in md
    # sao - grpo by seed: +0.25, +0.125, +0.125 -> mean 0.1667, the claim judged on them
    assert "| `sao > grpo` | final | 3 | 0.167 ± 0.072 [-0.013, 0.346] |" in md

    # a fourth seed here and a report older than runs.jsonl: numbers only, no curves
    old = _copy(tmp_path / "old", [_run("sao", 3, 0.5), _run("grpo", 3, 0.25)], jsonl=False)
    said.clear()
    assert run_experiment(EXP, dst, seeds=4, earlier=old, echo=said.append) == []
    assert "8 runs, 8 already finished (8 of them elsewhere, carried), 0 to run" in said[1]
    assert [(r.arm, r.seed) for r in earlier_runs(dst)] == [
        *((r.arm, r.seed) for r in RUNS),
        ("sao", 3),
        ("grpo", 3),
    ]
    rows = (dst / "results.csv").read_text().splitlines()
    assert [r.split(",")[:2] for r in rows[1:]] == [
        [a, str(s)] for a in ("sao", "grpo") for s in range(4)
    ]
    md = (dst / "results.md").read_text()
    assert "staleness or code version), absent from the plots: `sao` seed 3; `grpo` seed 3" in md
    assert "Code: every run ran `sao 0.1.0 + git abc`." in md  # those that recorded one

    # carrying the same runs again replaces them, it does not add a second copy
    carry(EXP, dst, src, [])
    assert len(earlier_runs(dst)) == 8


def test_runs_made_otherwise_are_refused(tmp_path: Path) -> None:
    other = Experiment("other", "x", "calc-tiny", EXP.arms, EXP.base)
    with pytest.raises(ConfigError, match="holds experiment 'other', not 'two'"):
        carry(EXP, tmp_path, _copy(tmp_path / "a", RUNS, exp=other), [])
    lr = Experiment("two", "x", "calc-tiny", {**EXP.arms, "sao": ("algo=sao", "x=1")}, EXP.base)
    with pytest.raises(ConfigError, match="made with another arm 'sao'"):
        carry(EXP, tmp_path, _copy(tmp_path / "b", RUNS, exp=lr), [])
    with pytest.raises(ConfigError, match="made with another overrides"):
        carry(EXP, tmp_path, _copy(tmp_path / "c", RUNS), ["train.actor_lr=1e-3"])
    with pytest.raises(ConfigError, match=r"holds no experiment\.json"):
        carry(EXP, tmp_path, tmp_path / "nothing", [])
    with pytest.raises(ConfigError, match="holds no finished runs"):
        carry(EXP, tmp_path, _copy(tmp_path / "d", []), [])
    switches = Experiment("two", "x", "calc-tiny", EXP.arms, EXP.base, marks=(2,))
    with pytest.raises(ConfigError, match="carry no curves"):
        carry(switches, tmp_path, _copy(tmp_path / "e", RUNS, jsonl=False, exp=switches), [])
    assert not (tmp_path / EARLIER_FILE).exists()  # nothing carried by a refusal
