"""Checkpoints and resume: what a checkpoint holds, that a crash while saving
never leaves a broken one, and that a resumed run continues exactly where
the checkpoint stood (step, version, weights, optimizers, buffer, prompts)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from sao.algo.presets import get_preset
from sao.app.run import train
from sao.config import Config, ConfigError, load_config
from sao.models.loading import load_policy
from sao.models.value import ValueModel
from sao.rundir import checkpoint as ckpt_mod
from sao.rundir.checkpoint import (
    latest_checkpoint,
    load_state,
    rewind_metrics,
    rng_state,
    save_checkpoint,
    set_rng_state,
    trajectory_from_dict,
    trajectory_to_dict,
)
from sao.train.critic_fit import CriticFit
from sao.train.trainer import OptimSettings, Trainer
from sao.types import SamplingParams, Trajectory, Turn
from tests.train.test_learning import SayATask


def traj(index: int, *, reward: float = 0.5, version: int = 0) -> Trajectory:
    """A two-turn episode over token ids of the tiny char tokenizer (vocab 8)."""
    return Trajectory(
        prompt_id=f"train/{index}",
        tokens=(1, 5, 6, 5, 2, 6, 6, 3),
        action_mask=(False, False, True, True, False, True, True, True),
        rollout_logp=(0.0, 0.0, -0.7, -1.2, 0.0, -0.3, -2.0, -0.1),
        versions=(-1, -1, version, version, -1, version + 1, version + 1, version + 1),
        turns=(
            Turn(start=2, end=4, obs_end=5, reward=0.25, env_latency_s=0.01),
            Turn(start=5, end=8, obs_end=8),
        ),
        reward=reward,
        finish_reason="env_error",
        sampling=SamplingParams(
            temperature=0.7, top_k=3, max_new_tokens=4, stop_token_ids=(3,), stop_strings=("\n",)
        ),
        group_id=f"train/{index}",
        error="ValueError: boom",
        metrics={"env_latency_s": 0.01, "turns": 2.0},
    )


# ---------------------------------------------------------------------- unit level


def test_trajectory_round_trips_through_json() -> None:
    t = traj(3, version=2)
    back = trajectory_from_dict(json.loads(json.dumps(trajectory_to_dict(t))))
    assert back == t
    assert isinstance(back.tokens, tuple) and isinstance(back.turns[0], Turn)
    assert back.sampling.stop_token_ids == (3,) and back.min_version == 2


def test_rng_state_round_trips_through_torch_save(tmp_path: Path) -> None:
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), torch.rand(3).tolist())
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=False))
    assert (random.random(), torch.rand(3).tolist()) == expected


def _trainer(policy_dir: Path, preset: str, seed: int) -> Trainer:
    algo = get_preset(preset)
    policy = load_policy(policy_dir)
    critic = ValueModel.from_policy(policy_dir, seed=seed) if algo.use_critic else None
    return Trainer(policy, critic, algo, OptimSettings(actor_lr=1e-2, critic_lr=1e-2))


@pytest.mark.parametrize("preset", ["sao", "running_mean"])
def test_checkpoint_holds_everything(tmp_path: Path, tiny_policy: Path, preset: str) -> None:
    trainer = _trainer(tiny_policy, preset, seed=0)
    for _ in range(2):
        trainer.step([traj(0, reward=1.0), traj(1, reward=0.0)])
    state = {"version": 2, "next_index": 5, "in_flight": [4], "gate": [4, 0, 0]}
    buffered = [traj(2, version=1), traj(3, version=2)]
    path = save_checkpoint(
        tmp_path,
        2,
        policy=trainer.policy,
        critic=trainer.critic,
        trainer_state=trainer.state_dict(),
        state=state,
        trajectories=buffered,
    )
    assert latest_checkpoint(tmp_path) == path
    saved, blob, trajs = load_state(path)
    assert saved == {"step": 2, **state}
    assert trajs == buffered
    assert set(blob["rng"]) == {"python", "numpy", "torch"}

    other = _trainer(tiny_policy, preset, seed=1)
    other.load_state_dict(blob["trainer"])
    _assert_optim_equal(other.actor_optim.state_dict(), trainer.actor_optim.state_dict())
    for k, v in load_policy(path / "policy").state_dict().items():
        assert torch.equal(v, trainer.policy.state_dict()[k]), k
    if trainer.critic is not None:
        assert other.critic_optim is not None and trainer.critic_optim is not None
        _assert_optim_equal(other.critic_optim.state_dict(), trainer.critic_optim.state_dict())
        assert other.critic_sched is not None and trainer.critic_sched is not None
        assert other.critic_sched.last_epoch == trainer.critic_sched.last_epoch == 4  # K=2 x 2
        critic = ValueModel.from_pretrained(path / "critic")
        for k, v in critic.state_dict().items():
            assert torch.equal(v, trainer.critic.state_dict()[k]), k
    if trainer.running_mean is not None:
        assert other.running_mean is not None
        assert other.running_mean.state_dict() == trainer.running_mean.state_dict()
        assert (
            other.running_mean.state_dict()
            != _trainer(tiny_policy, preset, 0).state_dict()["running_mean"]
        ), "two steps should have filled the running-mean window"


def _assert_optim_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for i, s in a["state"].items():
        for k, v in s.items():
            assert torch.equal(v, b["state"][i][k]), (i, k)


def _save(root: Path, step: int, policy: torch.nn.Module) -> Path:
    return save_checkpoint(
        root,
        step,
        policy=policy,  # type: ignore[arg-type]
        critic=None,
        trainer_state={},
        state={"version": step},
        trajectories=[traj(step)],
    )


def test_crash_while_saving_keeps_previous_checkpoint(
    tmp_path: Path, tiny_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = load_policy(tiny_policy)
    first = _save(tmp_path, 2, policy)

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError("No space left on device")

    with monkeypatch.context() as m:
        m.setattr(ckpt_mod.torch, "save", disk_full)
        with pytest.raises(OSError, match="No space"):
            _save(tmp_path, 4, policy)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp_step_000004")]
    assert leftovers, "the half-written checkpoint should sit under a temporary name"
    assert not (tmp_path / "step_000004").exists()
    assert latest_checkpoint(tmp_path) == first
    assert load_state(first)[0] == {"step": 2, "version": 2}

    # without a usable pointer, the highest complete step_* wins; temp dirs never do
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == first
    (tmp_path / "latest").write_text("step_000099")
    assert latest_checkpoint(tmp_path) == first

    third = _save(tmp_path, 6, policy)  # the next save sweeps the crashed one away
    assert latest_checkpoint(tmp_path) == third
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_latest_checkpoint_of_empty_root(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing") is None
    (tmp_path / ".tmp_step_000002_1").mkdir()
    (tmp_path / ".tmp_step_000002_1" / "state.json").write_text("{}")
    assert latest_checkpoint(tmp_path) is None


def test_rewind_metrics_drops_rows_after_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(5)))
    rewind_metrics(path, 2)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1, 2]
    rewind_metrics(tmp_path / "none.jsonl", 2)  # no metrics yet: nothing to do


# ---------------------------------------------------------------------- end to end


def tiny_config(policy: Path, run_dir: Path, *overrides: str) -> Config:
    """A run of a few seconds: batches of 4 single-turn episodes of <= 4 tokens, one
    critic-only warm-up step before the ``train.steps`` actor steps."""
    return load_config(
        overrides=[
            f"model.path={policy}", f"log.run_dir={run_dir}", "log.live=false",
            "log.tensorboard=false", "log.plots=false", "train.batch_size=4",
            "rollout.in_flight=4", "rollout.max_new_tokens=4", "rollout.max_turns=1",
            "rollout.max_total_tokens=32", "eval.every=100", "eval.episodes=2",
            "log.checkpoint_every=2", "runtime.max_lag=2", "algo.critic_pretrain_steps=1",
            *overrides,
        ]
    )  # fmt: skip


class StepRecorder:
    """Wraps ``Trainer.step``: records each batch's prompt ids, and snapshots the
    trainer (weights and optimizer state) at the first step after ``arm()``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.batches: list[list[str]] = []
        self.armed = False
        self.snapshot: dict[str, Any] = {}
        original = Trainer.step

        def step(trainer: Trainer, trajectories: list[Trajectory], **kw: bool) -> Any:
            if self.armed:
                self.armed = False
                self.snapshot = _snapshot(trainer)
            self.batches.append([t.prompt_id for t in trajectories])
            return original(trainer, trajectories, **kw)

        monkeypatch.setattr(Trainer, "step", step)

    def arm(self) -> None:
        self.armed = True
        self.batches = []

    def ids(self) -> list[str]:
        return [i for b in self.batches for i in b]


def _snapshot(trainer: Trainer) -> dict[str, Any]:
    out = {
        "policy": {k: v.clone() for k, v in trainer.policy.state_dict().items()},
        "actor_steps": _adam_steps(trainer.actor_optim.state_dict()),
    }
    if trainer.critic is not None and trainer.critic_optim is not None:
        out["critic"] = {k: v.clone() for k, v in trainer.critic.state_dict().items()}
        out["critic_steps"] = _adam_steps(trainer.critic_optim.state_dict())
    return out


def _adam_steps(optim_state: dict[str, Any]) -> set[float]:
    return {float(s["step"]) for s in optim_state["state"].values()}


def _metrics(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_continues_where_the_checkpoint_stood(
    tmp_path: Path, tiny_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    rec = StepRecorder(monkeypatch)
    train(tiny_config(tiny_policy, run_dir, "train.steps=3"), task=SayATask())
    before = rec.ids()
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None and ckpt.name == "step_000004"
    saved, blob, buffered = load_state(ckpt)
    assert saved["step"] == 4 and saved["version"] == 3  # 1 critic-only warm-up step
    assert buffered, "the checkpoint should hold finished, not yet trained trajectories"

    # the checkpoint accounts for every prompt started so far, each exactly once
    trained = {int(i.split("/")[1]) for i in before}
    held = {int(t.prompt_id.split("/")[1]) for t in buffered}
    restart = set(saved["in_flight"])
    assert len(before) == len(trained) == 16
    assert trained.isdisjoint(held) and trained.isdisjoint(restart) and held.isdisjoint(restart)
    assert trained | held | restart == set(range(saved["next_index"]))

    rec.arm()
    train(tiny_config(tiny_policy, run_dir, "train.steps=7"), task=SayATask(), resume=run_dir)
    after = rec.ids()

    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(9))
    assert [r["version"] for r in rows[1:]] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert rows[-1]["dropped/stale"] == 0, "test setup: nothing should be dropped as stale"
    # no trajectory trained twice; the buffered ones are trained first, then the restarts
    assert len(after) == len(set(after)) == 16
    assert set(before).isdisjoint(after)
    assert after[: len(buffered)] == [t.prompt_id for t in buffered]
    assert {f"train/{i}" for i in restart} <= set(after)
    # weights and optimizer state at the first resumed step are the checkpoint's
    snap = rec.snapshot
    for k, v in load_policy(ckpt / "policy").state_dict().items():
        assert torch.equal(snap["policy"][k], v), k
    for k, v in ValueModel.from_pretrained(ckpt / "critic").state_dict().items():
        assert torch.equal(snap["critic"][k], v), k
    assert snap["actor_steps"] == _adam_steps(blob["trainer"]["actor_optim"]) == {3.0}
    assert snap["critic_steps"] == _adam_steps(blob["trainer"]["critic_optim"]) == {8.0}


def test_resume_keeps_groups_whole(
    tmp_path: Path, tiny_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    rec = StepRecorder(monkeypatch)
    grpo = ("algo=grpo", "algo.group_size=2", "algo.critic_pretrain_steps=0")
    train(tiny_config(tiny_policy, run_dir, *grpo, "train.steps=4"), task=SayATask())
    before = rec.ids()
    rec.arm()
    train(
        tiny_config(tiny_policy, run_dir, *grpo, "train.steps=8"), task=SayATask(), resume=run_dir
    )
    after = rec.ids()
    assert [r["step"] for r in _metrics(run_dir)] == list(range(9))
    assert set(before).isdisjoint(after)
    for ids in (before, after):  # every trained prompt has exactly its 2 group members
        assert len(ids) == 16 and all(ids.count(i) == 2 for i in ids)


def test_resume_after_a_crash_while_checkpointing(
    tmp_path: Path, tiny_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    rec = StepRecorder(monkeypatch)
    real_save = torch.save
    calls = []

    def save_then_crash(obj: object, f: Path) -> None:
        calls.append(f)
        if len(calls) == 2:  # the checkpoint of step 4
            raise OSError("No space left on device")
        real_save(obj, f)

    with monkeypatch.context() as m:
        m.setattr(ckpt_mod.torch, "save", save_then_crash)
        with pytest.raises(OSError, match="No space"):
            train(tiny_config(tiny_policy, run_dir, "train.steps=3"), task=SayATask())
    first_two = [i for b in rec.batches[:2] for i in b]
    ckpts = run_dir / "checkpoints"
    assert latest_checkpoint(ckpts) == ckpts / "step_000002"
    assert any(p.name.startswith(".tmp_step_000004") for p in ckpts.iterdir())
    assert [r["step"] for r in _metrics(run_dir)] == [0, 1, 2, 3, 4]

    rec.arm()
    train(tiny_config(tiny_policy, run_dir, "train.steps=4"), task=SayATask(), resume=run_dir)
    assert [r["step"] for r in _metrics(run_dir)] == [0, 1, 2, 3, 4, 5]  # 3, 4 run again
    assert set(first_two).isdisjoint(rec.ids())
    assert len(rec.batches) == 3
    assert sorted(os.listdir(ckpts)) == ["latest", "step_000002", "step_000004", "step_000005"]


def test_resume_inside_critic_warmup_keeps_the_actor_frozen(
    tmp_path: Path, tiny_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    cfg = tiny_config(tiny_policy, run_dir, "algo.critic_pretrain_steps=3", "train.steps=1")
    original = Trainer.step
    calls = []

    def crash_at_third(trainer: Trainer, trajectories: list[Trajectory], **kw: bool) -> Any:
        calls.append(kw)
        if len(calls) == 3:
            raise RuntimeError("killed")
        return original(trainer, trajectories, **kw)

    with monkeypatch.context() as m:
        m.setattr(Trainer, "step", crash_at_third)
        with pytest.raises(RuntimeError, match="killed"):
            train(cfg, task=SayATask())
    assert latest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / "step_000002"
    train(cfg, task=SayATask(), resume=run_dir)
    # steps 1-3 train only the critic, step 4 is the one actor step
    assert [r.get("version") for r in _metrics(run_dir)] == [None, 0, 0, 0, 1]


def test_a_warmup_that_plateaus_hands_its_batches_to_the_actor_and_resumes(
    tmp_path: Path, tiny_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # at most 5 warm-up batches + 1 actor step = 6 batches; the held-out gain "stops
    # rising" at the 2nd warm-up batch, so batches 3-6 are actor steps (versions 1-4)
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        tiny_policy,
        run_dir,
        "algo.critic_pretrain_steps=5",
        "algo.critic_pretrain_patience=1",
        "train.steps=1",
    )
    asked = []
    monkeypatch.setattr(CriticFit, "plateaued", lambda fit, p: asked.append(p) or len(asked) >= 2)
    original = Trainer.step
    calls = []

    def crash_at_fourth(trainer: Trainer, trajectories: list[Trajectory], **kw: bool) -> Any:
        calls.append(kw["train_actor"])
        if len(calls) == 4:
            raise RuntimeError("killed")
        return original(trainer, trajectories, **kw)

    with monkeypatch.context() as m:
        m.setattr(Trainer, "step", crash_at_fourth)
        with pytest.raises(RuntimeError, match="killed"):
            train(cfg, task=SayATask())
    assert calls == [False, False, True, True] and asked == [1, 1]
    # the checkpoint of step 2 holds the decision: the resumed run trains the actor at once
    train(cfg, task=SayATask(), resume=run_dir)
    rows = _metrics(run_dir)
    assert [r.get("version") for r in rows] == [None, 0, 0, 1, 2, 3, 4]
    assert [r.get("critic/pretrain_plateau") for r in rows[1:3]] == [0.0, 1.0]
    assert asked == [1, 1]  # never asked again once the actor trains


def test_resume_rejects_what_cannot_change(tmp_path: Path, tiny_policy: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = tiny_config(tiny_policy, run_dir, "train.steps=2")
    with pytest.raises(ConfigError, match="not a run directory"):
        train(cfg, task=SayATask(), resume=run_dir)
    train(cfg, task=SayATask())
    changed = tiny_config(tiny_policy, run_dir, "train.steps=4", "train.actor_lr=0.5")
    with pytest.raises(ConfigError, match=r"train\.actor_lr"):
        train(changed, task=SayATask(), resume=run_dir)
