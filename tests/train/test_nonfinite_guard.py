"""Every NaN/inf on the way to an update skips that update and is counted: the
trainer's or the engine's log-probabilities, the critic's values (before or
during its K updates), the loss, the gradient, and the parameters AdamW would
produce. A skipped update leaves the weights and the optimizer state exactly
as they were, and ``max_bad_steps`` bad steps in a row stop with a
:class:`NonFiniteError` that names what diverged and the knobs to turn."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import sao.train.trainer as trainer_mod
from sao.algo.presets import get_preset
from sao.models.loading import load_policy
from sao.models.value import ValueModel
from sao.train.guard import NonFiniteError
from sao.train.precision import adamw_nonfinite, adamw_step_bound
from sao.train.trainer import OptimSettings, Trainer
from sao.types import Trajectory
from tests.train.test_nonfinite import traj

NAN = float("nan")


class Poison:
    """A forward hook multiplying a module's output by NaN from its ``start``-th
    call on (counting from 1) while ``on``."""

    def __init__(self, module: nn.Module, start: int = 1) -> None:
        self.on, self.start, self.calls = True, start, 0
        module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return out * NAN if self.on and self.calls >= self.start else out


def make(
    tiny_policy: Path, preset: str = "sao", **settings: Any
) -> tuple[Trainer, list[Trajectory]]:
    algo = get_preset(preset)
    critic = ValueModel.from_policy(tiny_policy, seed=0) if algo.use_critic else None
    base = dict(actor_lr=1e-2, critic_lr=1e-2, max_bad_steps=3)
    trainer = Trainer(load_policy(tiny_policy), critic, algo, OptimSettings(**base | settings))
    return trainer, [traj(0, 1.0), traj(1, 0.0)]


def snapshot(
    model: nn.Module | nn.Parameter | None, optim: torch.optim.Optimizer | None
) -> list[torch.Tensor]:
    """Parameters and every optimizer-state tensor, cloned."""
    assert model is not None and optim is not None
    params = [model] if isinstance(model, nn.Parameter) else list(model.parameters())
    out = [p.detach().clone() for p in params]
    for state in optim.state.values():
        out += [torch.as_tensor(v).clone() for v in state.values()]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def finite(model: nn.Module | None) -> bool:
    assert model is not None
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def actor_state(t: Trainer) -> list[torch.Tensor]:
    return snapshot(t.policy, t.actor_optim)


def critic_state(t: Trainer) -> list[torch.Tensor]:
    return snapshot(t.critic, t.critic_optim)


@contextmanager
def stops(*words: str) -> Iterator[None]:
    """The step raises NonFiniteError whose message holds every word."""
    with pytest.raises(NonFiniteError) as err:
        yield
    for w in words:
        assert w in str(err.value), str(err.value)


def test_nan_logprobs_skip_the_actor_and_keep_its_optimizer_state(tiny_policy: Path) -> None:
    trainer, batch = make(tiny_policy)
    trainer.step(batch)  # a good step: the actor has AdamW moments to keep
    poison = Poison(trainer.policy.get_output_embeddings())
    actor, critic = actor_state(trainer), critic_state(trainer)
    for n in (1, 2):
        stats = trainer.step(batch)
        assert same(actor_state(trainer), actor)  # weights and moments untouched
        assert not same(critic_state(trainer), critic)  # the critic's updates still apply
        critic = critic_state(trainer)
        assert float(stats["actor/skipped_steps"]) == n
        assert float(stats["critic/skipped_steps"]) == 0
        assert float(stats["train/consecutive_bad_steps"]) == n
        assert "actor/loss" not in stats  # no statistics from NaN log-probabilities
    poison.on = False
    stats = trainer.step(batch)  # a good step resets the count in a row, not the totals
    assert float(stats["train/consecutive_bad_steps"]) == 0
    assert float(stats["train/skipped_steps"]) == 2
    poison.on = True
    trainer.step(batch)
    trainer.step(batch)
    with stops("3 consecutive steps", "actor: NaN/inf log-probabilities", "train.actor_lr"):
        trainer.step(batch)
    assert finite(trainer.policy) and finite(trainer.critic)
    assert trainer.bad.per_model == {"actor": 5, "critic": 0}


def test_nan_rollout_logprobs_skip_the_actor(tiny_policy: Path) -> None:
    """An engine that sampled from NaN logits records NaN log-probabilities."""
    trainer, batch = make(tiny_policy, "grpo", max_bad_steps=1)
    bad = replace(batch[0], rollout_logp=(0.0, 0.0, -1.0, NAN, -1.0))
    actor = actor_state(trainer)
    with stops("actor: NaN/inf rollout log-probabilities"):
        trainer.step([bad, *batch[1:]])
    assert same(actor_state(trainer), actor)


def test_nan_values_skip_both_updates(tiny_policy: Path) -> None:
    trainer, batch = make(tiny_policy, max_bad_steps=2)
    assert trainer.critic is not None
    Poison(trainer.critic.value_head)
    actor, critic = actor_state(trainer), critic_state(trainer)
    stats = trainer.step(batch)
    assert same(actor_state(trainer), actor) and same(critic_state(trainer), critic)
    assert float(stats["critic/skipped_steps"]) == 1 and "train/advantage_mean" not in stats
    with stops("critic: NaN/inf values", "train.critic_lr", "train.max_bad_steps=2"):
        trainer.step(batch)


def test_values_that_turn_nan_during_the_critic_updates(tiny_policy: Path) -> None:
    """Calls of the critic in a step: 1 and 2 the K = 2 updates (the first also
    gives the values for the advantages). NaN from call 2: the first update is
    applied, the second skipped (the LR warm-up counts applied updates only)."""
    trainer, batch = make(tiny_policy)
    assert trainer.critic is not None and trainer.critic_sched is not None
    Poison(trainer.critic.value_head, start=2)
    before = critic_state(trainer)
    stats = trainer.step(batch)
    assert not same(critic_state(trainer), before) and finite(trainer.critic)
    assert trainer.critic_sched.last_epoch == 1
    assert float(stats["critic/skipped_steps"]) == 1
    assert torch.isfinite(stats["actor/grad_norm"])  # the actor used the values of call 1


@pytest.mark.parametrize("poison", ["nan", "inf", "inf_constant"])
def test_nonfinite_loss_is_skipped(
    tiny_policy: Path, monkeypatch: pytest.MonkeyPatch, poison: str
) -> None:
    """``inf_constant`` adds inf to the loss: its gradient stays finite, only the
    loss itself shows that something is wrong."""
    real = trainer_mod.policy_loss

    def policy_loss(*args: Any, **kwargs: Any) -> Any:
        loss, stats = real(*args, **kwargs)
        bad = {"nan": loss * NAN, "inf": loss * float("inf"), "inf_constant": loss + float("inf")}
        return bad[poison], stats

    monkeypatch.setattr(trainer_mod, "policy_loss", policy_loss)
    trainer, batch = make(tiny_policy, "grpo", max_bad_steps=1)
    actor = actor_state(trainer)
    with stops("actor: NaN/inf loss"):
        trainer.step(batch)
    assert same(actor_state(trainer), actor)


def test_an_update_that_would_overflow_is_skipped(tiny_policy: Path) -> None:
    """lr 1e39: torch's AdamW step would raise (its step size exceeds float32); the
    log-probabilities, the loss and the gradient are finite: only the update is caught."""
    trainer, batch = make(tiny_policy, "grpo", actor_lr=1e39, max_bad_steps=1)
    actor = actor_state(trainer)
    with stops("actor: NaN/inf update", "train.actor_lr (now 1e+39)"):
        trainer.step(batch)
    assert same(actor_state(trainer), actor)


def test_a_diverging_actor_keeps_its_last_applied_update(tiny_policy: Path) -> None:
    """lr 1e30: the first update is finite (weights ~1e31) and applied; whatever
    overflows next (the forward, the gradient or the update) is skipped."""
    trainer, batch = make(tiny_policy, "grpo", actor_lr=1e30, max_bad_steps=2)
    actor = actor_state(trainer)
    trainer.step(batch)
    first = actor_state(trainer)
    assert not same(first, actor) and finite(trainer.policy)
    trainer.step(batch)
    with stops("2 consecutive steps", "actor: NaN/inf"):
        trainer.step(batch)
    assert same(actor_state(trainer), first)


@pytest.mark.parametrize("lr", [1e-3, 1e9, 1e30, 1e39])
def test_adamw_prediction_matches_the_step(lr: float) -> None:
    """:func:`adamw_nonfinite` counts exactly the entries ``step()`` makes NaN/inf
    (all of them where torch's step raises), step after step, without changing
    the parameter or the optimizer state."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(64) * 3)
    optim = torch.optim.AdamW([p], lr=lr)
    for _ in range(8):
        p.grad = torch.randn(64)
        p.grad[:8] = 0.0  # zero gradients: only the decay moves those entries
        before = snapshot(p, optim) if optim.state else [p.detach().clone()]
        predicted = int(adamw_nonfinite(optim))
        assert same(snapshot(p, optim) if optim.state else [p.detach().clone()], before)
        try:
            optim.step()
        except RuntimeError as e:
            assert "overflow" in str(e) and predicted == p.numel()
            return
        assert predicted == int((~torch.isfinite(p)).sum()), (lr, predicted)
        if predicted:
            return
    assert lr < 1, "a huge learning rate overflows within 8 steps"


@pytest.mark.parametrize(
    ("betas", "wd"), [((0.9, 0.999), 0.01), ((0.5, 0.9), 0.0), ((0.9, 0.82), 0.1)]
)
def test_adamw_step_bound_holds(betas: tuple[float, float], wd: float) -> None:
    """After every step, no weight exceeds :func:`adamw_step_bound`: gradients that
    jump between tiny and huge, flip sign, or vanish (the worst case of the
    Cauchy-Schwarz bound is a long run of small gradients, then a large one)."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(256))
    optim = torch.optim.AdamW([p], lr=0.1, betas=betas, weight_decay=wd)
    for step in range(200):
        scale = 10.0 ** float(torch.randint(-8, 4, ()))
        p.grad = torch.randn(256) * scale * (step % 7 != 3)
        bound = float(adamw_step_bound(optim))
        optim.step()
        assert float(p.detach().abs().max()) <= bound * (1 + 1e-6), step
    optim.param_groups[0]["betas"] = (0.9, 0.8)  # b1^2 >= b2: no bound is known
    assert adamw_step_bound(optim) == float("inf")


def test_bad_steps_stop_a_critic_only_warmup_too(tiny_policy: Path) -> None:
    trainer, batch = make(tiny_policy, max_bad_steps=1)
    assert trainer.critic is not None
    Poison(trainer.critic.value_head)
    with stops("critic: NaN/inf values", "train.critic_lr"):
        trainer.step(batch, train_actor=False)


def test_counts_survive_a_checkpoint(tiny_policy: Path) -> None:
    trainer, batch = make(tiny_policy)
    trainer.step(batch)  # (sequence_logprobs checks its head once, on good weights)
    poison = Poison(trainer.policy.get_output_embeddings())
    trainer.step(batch)
    poison.on = False
    fresh, _ = make(tiny_policy)
    fresh.load_state_dict(trainer.state_dict())
    assert fresh.bad.per_model == {"actor": 1, "critic": 0} and fresh.bad.total == 1
