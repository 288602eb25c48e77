"""The NaN/inf guard: a step whose loss or gradient is not finite is skipped
and counted (``train/skipped_steps``); ``train.max_bad_steps`` such steps in a
row stop the run with :class:`NonFiniteError`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import sao.train.trainer as trainer_mod
from sao.algo.presets import get_preset
from sao.app.run import train
from sao.config import load_config
from sao.models.loading import load_policy
from sao.models.value import ValueModel
from sao.train.guard import NonFiniteError
from sao.train.trainer import OptimSettings, Trainer
from sao.types import Trajectory, Turn
from tests.train.test_learning import SayATask


class NanSwitch:
    """Patches the trainer's policy loss: multiplied by NaN while ``on``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, on: bool = True) -> None:
        self.on = on
        real = trainer_mod.policy_loss

        def policy_loss(*args: Any, **kwargs: Any) -> Any:
            loss, stats = real(*args, **kwargs)
            return (loss * float("nan") if self.on else loss), stats

        monkeypatch.setattr(trainer_mod, "policy_loss", policy_loss)


def traj(index: int, reward: float) -> Trajectory:
    return Trajectory(
        prompt_id=f"train/{index}",
        tokens=(1, 5, 6, 5, 3),
        action_mask=(False, False, True, True, True),
        rollout_logp=(0.0, 0.0, -1.0, -1.0, -1.0),
        versions=(-1, -1, 0, 0, 0),
        turns=(Turn(start=2, end=5, obs_end=5),),
        reward=reward,
        finish_reason="stop",
        group_id=f"train/{index}",
    )


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("preset", ["sao", "running_mean"])
def test_bad_steps_are_skipped_counted_and_stop_the_run(
    tiny_policy: Path, monkeypatch: pytest.MonkeyPatch, preset: str
) -> None:
    algo = get_preset(preset)
    critic = ValueModel.from_policy(tiny_policy, seed=0) if algo.use_critic else None
    settings = OptimSettings(actor_lr=1e-2, critic_lr=1e-2, max_bad_steps=3)
    trainer = Trainer(load_policy(tiny_policy), critic, algo, settings)
    batch = [traj(0, 1.0), traj(1, 0.0)]
    nan = NanSwitch(monkeypatch)

    actor = params(trainer.policy)
    for n in (1, 2):
        stats = trainer.step(batch)
        assert not torch.isfinite(stats["actor/grad_norm"])
        assert float(stats["train/skipped_steps"]) == n
        assert same(params(trainer.policy), actor)  # the actor update was skipped
    nan.on = False  # a good step resets the count of consecutive bad steps
    assert float(trainer.step(batch)["train/skipped_steps"]) == 2
    assert not same(params(trainer.policy), actor)
    nan.on = True
    trainer.step(batch)
    trainer.step(batch)
    with pytest.raises(NonFiniteError, match="3 consecutive steps"):
        trainer.step(batch)
    assert trainer.bad.total == 5


def test_critic_updates_do_not_hide_a_diverged_actor(
    tiny_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a critic (K = 2 finite updates per step) a NaN actor still stops the run."""
    critic = ValueModel.from_policy(tiny_policy, seed=0)
    trainer = Trainer(
        load_policy(tiny_policy), critic, get_preset("sao"), OptimSettings(max_bad_steps=2)
    )
    NanSwitch(monkeypatch)
    before = params(critic)
    stats = trainer.step([traj(0, 1.0)])
    assert torch.isfinite(stats["critic/grad_norm"]) and not same(params(critic), before)
    with pytest.raises(NonFiniteError):
        trainer.step([traj(0, 1.0)])


def test_training_run_stops_after_max_bad_steps(
    tmp_path: Path, tiny_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    cfg = load_config(
        overrides=[
            f"model.path={tiny_policy}", f"log.run_dir={run_dir}", "log.live=false",
            "log.tensorboard=false", "log.plots=false", "train.steps=10", "train.batch_size=4",
            "train.max_bad_steps=3", "algo.critic_pretrain_steps=1", "rollout.in_flight=4",
            "rollout.max_new_tokens=4", "rollout.max_turns=1", "rollout.max_total_tokens=32",
            "eval.every=100", "eval.episodes=2", "log.checkpoint_every=2",
        ]
    )  # fmt: skip
    NanSwitch(monkeypatch)
    with pytest.raises(NonFiniteError):
        train(cfg, task=SayATask())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # step 1 is the critic-only warm-up; actor steps 2 and 3 are skipped; 4 stops the run
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["train/skipped_steps"] for r in rows[1:]] == [0, 1, 2]
    saved = load_policy(run_dir / "checkpoints" / "step_000002" / "policy")
    assert same(params(saved), params(load_policy(tiny_policy)))  # never stepped on NaN
