"""End to end: what a crash leaves behind does not stop a resume. A damaged
newest checkpoint is skipped for the previous one, torn last lines of the
logs are repaired, a run killed before its first checkpoint starts over,
and the run's counters (wall-clock time, failed episodes, idle time) go on
from the checkpoint instead of from 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sao.app.run import train
from sao.config import ConfigError
from sao.envs.base import Split
from sao.rundir.checkpoint import latest_checkpoint
from sao.rundir.ledger import LEDGER, check_ledger
from sao.runtime.orchestrator import Orchestrator
from sao.train.trainer import Trainer
from sao.types import Env, StepResult, Trajectory
from tests.rundir.test_checkpoint_resume import _metrics, tiny_config
from tests.train.test_learning import SayAEnv, SayATask


class _BrokenEnv(SayAEnv):
    async def step(self, action: str) -> StepResult:
        raise RuntimeError("the environment broke")


class FlakyTask(SayATask):
    """SayA, where every third training prompt's environment raises (``env_error``)."""

    def make_env(self, split: Split, index: int) -> Env:
        return _BrokenEnv() if split == "train" and index % 3 == 0 else SayAEnv()


def test_resume_continues_the_counters(
    tmp_path: Path, tiny_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    train(tiny_config(tiny_policy, run_dir, "train.steps=3", "log.ledger=true"), task=FlakyTask())
    state = json.loads((run_dir / "checkpoints" / "step_000004" / "state.json").read_text())
    saved = state["counters"]
    assert saved["env_errors"] > 0 and saved["episodes_done"] > 0 and saved["wall_s"] > 0
    loaded: list[dict[str, float]] = []
    original = Orchestrator.load_counters

    def load_counters(orch: Orchestrator, counters: dict[str, float]) -> None:
        loaded.append(counters)
        original(orch, counters)

    monkeypatch.setattr(Orchestrator, "load_counters", load_counters)
    cfg = tiny_config(tiny_policy, run_dir, "train.steps=5", "log.ledger=true")
    train(cfg, task=FlakyTask(), resume=run_dir)
    assert loaded == [saved]
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(7))
    resumed = rows[5]  # the first step after the checkpoint of step 4
    assert resumed["wall_s"] > saved["wall_s"]
    assert resumed["episodes/env_error"] >= saved["env_errors"]
    for key in ("wall_s", "episodes/env_error"):
        values = [r[key] for r in rows[1:]]
        assert values == sorted(values), key
    assert check_ledger(run_dir / LEDGER).problems == []  # failed episodes count as rejected


def test_resume_skips_a_damaged_checkpoint_and_repairs_torn_logs(
    tmp_path: Path, tiny_policy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    train(tiny_config(tiny_policy, run_dir, "train.steps=3", "log.ledger=true"), task=SayATask())
    trainer_pt = run_dir / "checkpoints" / "step_000004" / "trainer.pt"
    trainer_pt.write_bytes(trainer_pt.read_bytes()[:100])
    for name in ("metrics.jsonl", LEDGER):  # killed while writing a line
        with (run_dir / name).open("a") as f:
            f.write('{"step": 5, "ev')
    capsys.readouterr()
    cfg = tiny_config(tiny_policy, run_dir, "train.steps=4", "log.ledger=true")
    train(cfg, task=SayATask(), resume=run_dir)
    out = capsys.readouterr().out
    assert "resume: skipping damaged checkpoint step_000004: trainer.pt has 100 bytes" in out
    assert "from checkpoint step_000002" in out
    assert [r["step"] for r in _metrics(run_dir)] == list(range(6))
    # the evaluation at step 4 came after the checkpoint used: rewound with the metrics
    samples = (run_dir / "eval_samples.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in samples] == [0, 0, 5, 5]
    check = check_ledger(run_dir / LEDGER)
    assert check.problems == [] and check.steps == 5 and check.starts == 2
    ckpts = run_dir / "checkpoints"
    assert (ckpts / ".damaged_step_000004" / "trainer.pt").stat().st_size == 100
    assert latest_checkpoint(ckpts) == ckpts / "step_000005"


def test_resume_before_the_first_checkpoint_starts_over(
    tmp_path: Path,
    tiny_policy: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_dir = tmp_path / "run"
    cfg = tiny_config(tiny_policy, run_dir, "train.steps=3", "log.ledger=true")
    original = Trainer.step

    def killed(trainer: Trainer, trajectories: list[Trajectory], **kw: bool) -> Any:
        raise RuntimeError("killed")

    with monkeypatch.context() as m:
        m.setattr(Trainer, "step", killed)
        with pytest.raises(RuntimeError, match="killed"):
            train(cfg, task=SayATask())
    assert latest_checkpoint(run_dir / "checkpoints") is None
    assert [r["step"] for r in _metrics(run_dir)] == [0]
    with pytest.raises(ConfigError, match="already holds a run"):
        train(cfg, task=SayATask())
    assert Trainer.step is original
    capsys.readouterr()
    train(cfg, task=SayATask(), resume=run_dir)
    out = capsys.readouterr().out
    assert "stopped before its first checkpoint; starting it over from scratch" in out
    assert [r["step"] for r in _metrics(run_dir)] == list(range(5))
    check = check_ledger(run_dir / LEDGER)
    assert check.problems == [] and check.steps == 4 and check.starts == 1
