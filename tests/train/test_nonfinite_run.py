"""End to end: ``train.actor_lr=1e9`` diverges after one update (its weights are
finite, the next forward pass is not). The run skips and counts the bad steps,
stops after ``train.max_bad_steps`` of them in a row with one clear line naming
the knobs (exit 1, no traceback), and every checkpoint holds finite weights."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sao.app.run
from sao.app.run import train
from sao.cli import main
from sao.config import load_config
from sao.models.loading import load_policy
from sao.models.value import ValueModel
from sao.train.guard import NonFiniteError
from tests.train.test_learning import SayATask


def overrides(policy: Path, run_dir: Path) -> list[str]:
    return [
        f"model.path={policy}", f"log.run_dir={run_dir}", "log.live=false",
        "log.tensorboard=false", "log.plots=false", "train.steps=10", "train.batch_size=4",
        "train.max_bad_steps=2", "train.actor_lr=1e9", "algo.critic_pretrain_steps=0",
        "rollout.in_flight=4", "rollout.max_new_tokens=4", "rollout.max_turns=1",
        "rollout.max_total_tokens=64", "eval.every=100", "eval.episodes=2",
        "log.checkpoint_every=1",
    ]  # fmt: skip


def finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def assert_finite_checkpoints(run_dir: Path) -> list[str]:
    """Every checkpoint's policy and critic are finite; returns their names."""
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert steps
    for step in steps:
        ckpt = run_dir / "checkpoints" / step
        assert finite(load_policy(ckpt / "policy")), step
        assert finite(ValueModel.from_pretrained(ckpt / "critic")), step
    return steps


def test_a_diverged_run_stops_cleanly_with_finite_weights(
    tmp_path: Path, tiny_policy: Path
) -> None:
    run_dir = tmp_path / "run"
    cfg = load_config(overrides=overrides(tiny_policy, run_dir))
    with pytest.raises(NonFiniteError) as err:
        train(cfg, task=SayATask())
    msg = str(err.value)
    assert "2 consecutive steps" in msg and "actor: NaN/inf" in msg
    assert "train.actor_lr (now 1e+09)" in msg and "train.max_bad_steps" in msg
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # step 1's update is applied (finite, huge); step 2 is bad; step 3 stops the run
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["actor/skipped_steps"] for r in rows[1:]] == [0, 1]
    assert [r["train/consecutive_bad_steps"] for r in rows[1:]] == [0, 1]
    assert assert_finite_checkpoints(run_dir) == ["step_000001", "step_000002"]
    one, two = (
        load_policy(run_dir / "checkpoints" / s / "policy") for s in ("step_000001", "step_000002")
    )
    for a, b in zip(one.parameters(), two.parameters(), strict=True):
        assert torch.equal(a, b)  # the bad step left the weights of step 1 as they were
    final = load_policy(run_dir / "final")  # exported at the stop: the weights of step 1
    for a, b in zip(one.parameters(), final.parameters(), strict=True):
        assert torch.equal(a, b)


def test_sao_train_reports_the_stop_in_one_line(
    tmp_path: Path,
    tiny_policy: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``sao train`` itself (its ``main``), with the toy task handed to the run."""
    monkeypatch.setattr(sao.app.run, "train", functools.partial(train, task=SayATask()))
    argv = ["train"] + [a for o in overrides(tiny_policy, tmp_path / "run") for a in ("--set", o)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("sao: stopped: 2 consecutive steps")
    assert "train.actor_lr (now 1e+09)" in err
    assert_finite_checkpoints(tmp_path / "run")


@pytest.mark.slow
def test_sao_train_subprocess_exits_1_without_a_traceback(
    tmp_path: Path, tiny_policy: Path
) -> None:
    """The real command on a built-in task (guess_number) in a fresh process."""
    run_dir = tmp_path / "run"
    args = [
        a
        for o in [*overrides(tiny_policy, run_dir), "task.name=guess_number"]
        for a in ("--set", o)
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "sao.cli", "train", *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("sao: stopped: ") and "train.actor_lr" in last
    assert_finite_checkpoints(run_dir)


def test_a_stop_raised_in_a_trainer_rank_actor_prints_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``runtime.backend=ray`` the error comes back wrapped in Ray's
    RayTaskError, whose text holds the actor's traceback: only the cause is printed."""
    exceptions = pytest.importorskip("ray.exceptions")

    def diverge(*args: object, **kwargs: object) -> Path:
        try:
            raise NonFiniteError("3 consecutive steps had NaN/inf values (train.max_bad_steps=3)")
        except NonFiniteError as e:
            import traceback

            wrapped = exceptions.RayTaskError("TrainerRank.step", traceback.format_exc(), e)
            raise wrapped.as_instanceof_cause() from None

    monkeypatch.setattr(sao.app.run, "train", diverge)
    assert main(["train", "--set", "log.live=false"]) == 1
    err = capsys.readouterr().err
    assert err == "sao: stopped: 3 consecutive steps had NaN/inf values (train.max_bad_steps=3)\n"
