"""One trainer step: K critic updates with frozen attention (the first one's
forward also gives the values for the advantages), advantages, the actor
update. ``Trainer.step`` reads as the algorithm.

Device: every tensor the step builds lives on the policy's device (the batch is
collated on the CPU, then moved once); the returned metrics are CPU tensors.
Precision: the optimizers step float32 master weights
(:class:`~sao.train.precision.MasterWeights`), whatever the models' dtype.
NaN/inf: an update is applied only when everything on its way is finite (the
inputs of its loss, the loss, the gradient norm, the parameters AdamW would
produce); otherwise it is skipped, so a model's weights and optimizer state are
always those of its last good update, and ``max_bad_steps`` bad steps in a row
stop the run with :class:`~sao.train.guard.NonFiniteError`.
Ranks: the :class:`~sao.train.sharded.RankContext` builds the models (FSDP2 with
N ranks) and picks this rank's micro-batches; every quantity that is not
row-local (denominators, advantages, statistics) comes from the whole batch, so
the step is the same code on one rank or many (sao/train/sharded.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import torch
from torch import nn
from transformers import PreTrainedModel

from sao.algo.aggregate import aggregate_denom
from sao.algo.baselines import RunningMeanBaseline, overlong_penalty
from sao.algo.losses import value_loss
from sao.algo.presets import AlgoPreset
from sao.models.value import ValueModel
from sao.train.critic_fit import CriticFit, first_action_values, turn_start_values
from sao.train.estimators import (
    CRITIC_ADVANTAGES,
    Stats,
    Targets,
    compute_targets,
    critic_mask,
    critic_returns,
    gae_gap,
    needs_old_logp,
    policy_loss,
)
from sao.train.guard import WHAT, BadSteps, Guard, nonfinite
from sao.train.precision import (
    MasterWeights,
    adamw,
    adamw_nonfinite,
    adamw_step_bound,
    warmup,
)
from sao.train.sharded import PolicyLogprobs, RankContext, clip_grad_norm
from sao.train.split import worth_packing
from sao.types import Batch, Trajectory, collate


class _Stateful(Protocol):
    """What a checkpoint saves of the trainer: an optimizer, a scheduler, a baseline..."""

    def state_dict(self) -> Any: ...  # each part's own state type

    def load_state_dict(self, state: Any) -> Any: ...


@dataclass(frozen=True)
class OptimSettings:
    """Optimisation knobs the trainer needs (from ``TrainConfig``)."""

    actor_lr: float = 2e-4
    critic_lr: float = 1e-3
    critic_lr_warmup_steps: int = 10
    actor_lr_warmup_steps: int = 0
    grad_clip: float = 1.0
    token_budget: int = 8192
    max_bad_steps: int = 3
    temperature: float = 1.0
    max_action_tokens: int = 256
    packing: bool | Literal["auto"] = False
    """Padding-free micro-batches (:mod:`sao.models.packing`); ``auto``: on the
    CPU, each step whose padded plan would run much padding
    (:data:`sao.train.split.PACK_WASTE`); padded on CUDA (not measured yet)."""


_UPDATE = "update (AdamW would make weights NaN/inf)"
_CriticTargets = tuple[torch.Tensor | None, torch.Tensor | None]
"""A micro-batch's critic returns and its values before the update (or None)."""
_SAFE = torch.finfo(torch.float32).max / 4
"""Below this bound of every weight after an update (``adamw_step_bound``), no
weight can overflow; above it the update is predicted exactly."""


class Trainer:
    """Actor (policy) and critic updates for one algorithm preset."""

    def __init__(
        self,
        policy: PreTrainedModel | None,
        critic: ValueModel | None,
        algo: AlgoPreset,
        settings: OptimSettings,
        ranks: RankContext | None = None,
    ) -> None:
        """``policy`` None: the critic alone (its ranks of their own, ``runtime.critic_ranks``);
        ``critic`` None with a critic algorithm: the actor alone, advantages come from those."""
        model = policy if policy is not None else critic
        assert model is not None, "a trainer trains a policy, a critic or both"
        self.device = next(model.parameters()).device
        # auto: each step packs if its padded plan would run much padding (on the CPU,
        # where that was measured to win; never on CUDA, not measured yet)
        self.auto_packing = settings.packing == "auto" and self.device.type == "cpu"
        if settings.packing == "auto":
            settings = replace(settings, packing=self.auto_packing)
        self.packing = settings.packing is True  # this step's (auto: set by prepare)
        self.policy, self.critic, self.algo, self.opt = policy, critic, algo, settings
        self.ranks = RankContext() if ranks is None else ranks
        # FSDP2 with N ranks (before the optimizers: parameters become DTensors); as is on one
        self.actor: nn.Module | None = None
        self.actor_weights: MasterWeights | None = None
        self.actor_optim: torch.optim.Optimizer | None = None
        self._logprobs: PolicyLogprobs | None = None  # the actor (FSDP2 shards it in place)
        self.actor_sched: torch.optim.lr_scheduler.LRScheduler | None = None
        if policy is not None:
            self._logprobs = PolicyLogprobs(policy, settings.temperature, self.packing)
            self.actor = self.ranks.shard(self._logprobs)
            self.actor_weights = MasterWeights(p for p in policy.parameters() if p.requires_grad)
            self.actor_optim = adamw(self.actor_weights.params, settings.actor_lr)
            self.actor_sched = warmup(self.actor_optim, settings.actor_lr_warmup_steps)
        if critic is not None:
            self.ranks.shard(critic)
        self.critic_weights: MasterWeights | None = None
        self.critic_optim: torch.optim.Optimizer | None = None
        self.critic_sched: torch.optim.lr_scheduler.LRScheduler | None = None
        if critic is not None:
            self.critic_weights = MasterWeights(p for p in critic.parameters() if p.requires_grad)
            self.critic_optim = adamw(self.critic_weights.params, settings.critic_lr)
            self.critic_sched = warmup(self.critic_optim, settings.critic_lr_warmup_steps)
        self.running_mean = (
            RunningMeanBaseline(algo.running_mean_window, algo.running_mean_per_prompt)
            if algo.advantage == "running_mean"
            else None
        )
        self.fit = CriticFit()  # the critic's out-of-sample predictions (critic/heldout_*)
        self.lambda_1 = False  # this step's actor advantages used lambda 1 (not ready)
        self.gap: Stats = {}  # this step's critic/gae_gap_rms, critic/mc_adv_rms
        lrs = {"actor": settings.actor_lr, "critic": settings.critic_lr}
        self.bad = BadSteps(settings.max_bad_steps, lrs)  # NaN/inf steps: skipped, counted

    # ------------------------------------------------------------------ the step

    def step(self, trajectories: Sequence[Trajectory], *, train_actor: bool = True) -> Stats:
        """One actor step (or a critic-only warm-up step) on finished trajectories."""
        self.bad.begin_step()
        t0 = time.perf_counter()
        batch = self.prepare(trajectories)
        stats: Stats = {}
        # a critic whose bottom layers are frozen (algo.critic_train_layers) runs them once
        # for the batch, not once per forward (its values are the same numbers)
        cache: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self.critic is not None and self.ranks.world_size == 1:
            cache = self.critic.trunk_cache()
        with cache:
            if self.critic is not None and self.algo.advantage in CRITIC_ADVANTAGES:
                # the values for GAE are the first critic update's forward (one forward saved)
                values_BT, stats = self.first_critic_update(batch)
                targets = self.targets(batch, values_BT, self.running_mean)
                if targets is not None:
                    stats |= self.update_critic(batch, targets, values_BT, first_done=True)
                    if self.algo.advantages_after_critic_update and train_actor:
                        values = self.values(batch)
                        targets = self.targets(batch, values, None, before_update=False)
            else:
                targets = self.targets(batch, self.values(batch), self.running_mean)
        # where the step's time went (each phase ends on a host sync: `_apply`'s counts)
        stats["time/critic_s"] = self.since(t0)
        if train_actor and targets is not None:
            t1 = time.perf_counter()
            stats |= self.update_actor(batch, targets.advantages_BT)
            stats["time/actor_s"] = self.since(t1)
        patience = self.algo.critic_pretrain_patience
        if not train_actor and patience is not None:  # value pretraining until its plateau
            done = float(self.fit.plateaued(patience))
            stats["critic/pretrain_plateau"] = torch.tensor(done, device=self.device)
        self.bad.end_step()
        return to_cpu(stats | self.batch_stats(batch, targets))

    # ------------------------------------------------------------------ phases

    def prepare(self, trajectories: Sequence[Trajectory]) -> Batch:
        """Collate onto the policy's device; drop truncated rows if asked; apply
        DAPO's overlong shaping."""
        trajs = list(trajectories)
        if self.algo.truncation == "drop":
            trajs = [t for t in trajs if not t.truncated] or trajs
        batch = collate(trajs).to(self.device)
        if self.auto_packing:
            self.use_packing(worth_packing([len(t.tokens) for t in trajs], self.opt.token_budget))
        if self.algo.overlong_penalty:
            lengths_B = batch.action_mask_BT.sum(dim=1)
            cache = max(self.opt.max_action_tokens // 4, 1)
            pen_B = overlong_penalty(lengths_B, max_len=self.opt.max_action_tokens, cache_len=cache)
            last_B = _last_action_index(batch.action_mask_BT)
            rows = torch.arange(batch.size, device=self.device)[last_B >= 0]
            batch.rewards_BT[rows, last_B[rows]] += pen_B[rows].to(batch.rewards_BT.dtype)
            batch.rewards_B.add_(pen_B.to(batch.rewards_B.dtype))
        return batch

    def targets(
        self,
        batch: Batch,
        values_BT: torch.Tensor | None,
        running_mean: RunningMeanBaseline | None,
        *,
        before_update: bool = True,
    ) -> Targets | None:
        """Advantages and critic targets; None when the critic's values are NaN/inf
        on an action token: nothing can be trained on this batch, so the step is bad
        (counted against the critic) and both updates are skipped. The values are the
        whole batch's, so every rank agrees. Values from ``before_update`` the critic
        saw this batch are out-of-sample predictions: they go into :attr:`fit`, and
        until the critic is ready (``algo.critic_ready_gain``) the actor's lambda is 1."""
        if values_BT is not None and nonfinite(batch.action_mask_BT, values_BT=values_BT):
            self.bad.found["critic"] = "values (nothing was trained this step)"
            return None
        algo = self.actor_algo()
        self.lambda_1 = algo is not self.algo  # (logged: critic/actor_lambda_1)
        targets = compute_targets(algo, batch, values_BT, running_mean)
        if before_update and values_BT is not None and targets.returns_BT is not None:
            self.fit.record(
                *first_action_values(values_BT, targets.returns_BT, batch.action_mask_BT)
            )
            self.fit.record_turns(
                turn_start_values(values_BT, targets.returns_BT, batch.turn_id_BT)
            )
            self.gap = gae_gap(self.algo, batch, values_BT)
        return targets

    def actor_algo(self) -> AlgoPreset:
        """The preset the advantages use: lambda 1 for the actor while the critic
        is not yet ready (``algo.critic_ready_gain``), else the preset as is."""
        gain = self.algo.critic_ready_gain
        if gain is None or self.fit.ready(gain):
            return self.algo
        return self.algo.with_(lam_actor=1.0)

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor | None:
        """Critic values ``[B, T]`` for the whole batch (no gradient), or None."""
        if self.critic is None:
            return None
        out = batch.rollout_logp_BT.new_zeros(batch.tokens_BT.shape, dtype=torch.float32)
        for mb, rows in self._with_rows(batch):
            v = self.critic(mb.tokens_BT, mb.attention_mask_BT, packed=self.packing).float()
            out[rows, : v.shape[1]] = v
        return self.ranks.sum_rows(out)  # each row was filled by one rank

    def first_critic_update(self, batch: Batch) -> tuple[torch.Tensor, Stats]:
        """The first of the K critic updates, whose forward also gives the values
        ``[B, T]`` for GAE: the critic before any update, the same numbers as
        :meth:`values` with one forward fewer. Each micro-batch's returns come
        from its own values (:func:`critic_returns` is row-local, so they equal
        the whole batch's). A NaN/inf value on an action token skips the update
        (:meth:`targets` then finds it and nothing trains this step)."""
        values_BT = torch.zeros_like(batch.rollout_logp_BT, dtype=torch.float32)

        def targets(mb: Batch, rows: torch.Tensor, v_BT: torch.Tensor) -> _CriticTargets:
            v_BT = v_BT.detach()
            values_BT[rows, : v_BT.shape[1]] = v_BT
            if nonfinite(mb.action_mask_BT, values_BT=v_BT) is not None:
                return None, None  # (GAE rejects NaN/inf values)
            return critic_returns(self.algo, mb, v_BT)[0], v_BT  # v: value clipping's anchor

        stats = self._critic_step(batch, critic_mask(self.algo, batch), targets)
        return self.ranks.sum_rows(values_BT), stats  # each row was filled by one rank

    def update_critic(
        self,
        batch: Batch,
        targets: Targets,
        old_values_BT: torch.Tensor | None = None,
        *,
        first_done: bool = False,
    ) -> Stats:
        """K critic optimizer steps on fixed lam=1 targets (paper section 4), or
        the K - 1 after :meth:`first_critic_update` (``first_done``).
        ``old_values_BT``, the values before the update (those that made the
        advantages), anchor optional value clipping and give the critic's
        statistics (loss, explained variance: how well it predicted this batch
        before fitting it, as PPO reports them), so no forward runs for metrics."""
        assert targets.returns_BT is not None and targets.critic_mask_BT is not None
        mask, returns_BT = targets.critic_mask_BT, targets.returns_BT

        def fixed(mb: Batch, rows: torch.Tensor, v_BT: torch.Tensor) -> _CriticTargets:
            T = v_BT.shape[1]
            old = None if old_values_BT is None else old_values_BT[rows, :T]
            return returns_BT[rows, :T], old

        stats: Stats = {}
        for _ in range(self.algo.critic_steps - int(first_done)):
            stats = self._critic_step(batch, mask, fixed)
        scored = old_values_BT is not None and bool(mask.any())
        if scored and not nonfinite(mask, values_BT=old_values_BT, returns_BT=returns_BT):
            stats |= value_loss(old_values_BT, returns_BT, mask)[1]  # type: ignore[arg-type]
        return stats

    def _critic_step(
        self,
        batch: Batch,
        mask_BT: torch.Tensor,
        targets: Callable[[Batch, torch.Tensor, torch.Tensor], _CriticTargets],
    ) -> Stats:
        """One critic optimizer step over micro-batches; ``targets(mb, rows,
        values)`` gives a micro-batch's returns (None: its values are NaN/inf)
        and the values before the update (None: no value clipping)."""
        assert self.critic is not None and self.critic_weights is not None
        assert self.critic_optim is not None
        denom = aggregate_denom(mask_BT) if bool(mask_BT.any()) else 1.0
        self.critic_optim.zero_grad(set_to_none=True)
        guard = Guard(self.device)
        for mb, rows in self._with_rows(batch):
            v = self.critic(mb.tokens_BT, mb.attention_mask_BT, packed=self.packing)
            m = mask_BT[rows, : v.shape[1]]
            ret, old = targets(mb, rows, v)
            if ret is None:
                guard.bad_inputs += 1
                guard.what = guard.what or WHAT["values_BT"]
            if ret is None or not guard.usable(m, values_BT=v, returns_BT=ret, old_values_BT=old):
                _zero_loss(v).backward()  # still a backward: ranks run the same passes
                continue
            clip = None if old is None else self.algo.value_clip
            loss, _ = value_loss(v, ret, m, denom=denom, old_values_BT=old, clip_eps=clip)
            guard.loss(loss)
            loss.backward()
        norm, applied = self._apply("critic", self.critic_weights, self.critic_optim, guard)
        if applied and self.critic_sched is not None:  # warm-up counts applied steps
            self.critic_sched.step()
        return {"critic/grad_norm": norm}

    def update_actor(self, batch: Batch, advantages_BT: torch.Tensor) -> Stats:
        """One actor optimizer step over micro-batches (gradients accumulate
        exactly); the loss statistics come from the whole batch's log-probs.
        PPO-family losses compare against the pre-update policy: with one update
        per batch that is this forward's own log-probs (detached), no forward of its own."""
        actor, weights, optim = self.actor_parts()
        mask = batch.action_mask_BT
        reduction = "seq_mean_token_mean" if self.algo.loss == "gspo" else self.algo.reduction
        denom = aggregate_denom(mask, reduction)
        with_old = needs_old_logp(self.algo)
        optim.zero_grad(set_to_none=True)
        logp_BT = torch.zeros_like(batch.rollout_logp_BT, dtype=torch.float32)
        guard = Guard(self.device)
        for mb, rows in self._with_rows(batch):
            T = mb.tokens_BT.shape[1]
            logp = actor(mb.tokens_BT, mb.attention_mask_BT)
            logp_BT[rows, :T] = logp.detach()
            old_mb = logp.detach() if with_old else None
            args = (mb.rollout_logp_BT, old_mb, advantages_BT[rows, :T], mb.action_mask_BT)
            inputs = dict(logp_BT=logp, rollout_logp_BT=args[0], old_logp_BT=old_mb)
            if not guard.usable(mb.action_mask_BT, advantages_BT=args[2], **inputs):
                _zero_loss(logp).backward()  # still a backward: ranks run the same passes
                continue
            loss, _ = policy_loss(self.algo, logp, *args, denom)
            guard.loss(loss)
            loss.backward()
        norm, applied = self._apply("actor", weights, optim, guard)
        if applied and self.actor_sched is not None:  # warm-up counts applied steps
            self.actor_sched.step()
        logp_BT = self.ranks.sum_rows(logp_BT)
        old = logp_BT if with_old else None
        stats: Stats = {"actor/grad_norm": norm}
        whole = (batch.rollout_logp_BT, old, advantages_BT, mask)
        inputs = dict(rollout_logp_BT=batch.rollout_logp_BT, old_logp_BT=old)
        if not nonfinite(mask, logp_BT=logp_BT, advantages_BT=advantages_BT, **inputs):
            with torch.no_grad():  # whole-batch statistics, the same on every rank
                loss, loss_stats = policy_loss(self.algo, logp_BT, *whole, denom)
            stats |= loss_stats | {"actor/loss": loss}
        return stats

    # ------------------------------------------------------------------ helpers

    def actor_parts(self) -> tuple[nn.Module, MasterWeights, torch.optim.Optimizer]:
        """The actor, its float32 masters and its optimizer (an error without a policy)."""
        if self.actor is None or self.actor_weights is None or self.actor_optim is None:
            raise RuntimeError("this trainer holds no policy (its critic trains on its own ranks)")
        return self.actor, self.actor_weights, self.actor_optim

    def use_packing(self, packed: bool) -> None:
        """Run the next forwards packed or padded (the same numbers to 1e-5)."""
        self.packing = packed
        if self._logprobs is not None:
            self._logprobs.packed = packed

    def since(self, t0: float) -> torch.Tensor:
        """Seconds since ``t0`` (a metric)."""
        return torch.tensor(time.perf_counter() - t0, device=self.device)

    def _with_rows(self, batch: Batch) -> Iterator[tuple[Batch, torch.Tensor]]:
        return self.ranks.micro_batches(batch, self.opt.token_budget, packed=self.packing)

    def _apply(
        self, model: str, weights: MasterWeights, optim: torch.optim.Optimizer, guard: Guard
    ) -> tuple[torch.Tensor, bool]:
        """Clip; step the float32 masters and write them back into the model only
        if, on every rank, the loss inputs and losses (``guard``), the gradient norm
        and the parameters AdamW would produce are all finite (a bound rules an
        overflow out for one read of the weights; near float32's range the update
        is predicted exactly). A skipped update
        leaves weights and optimizer state untouched: nothing to roll back.
        Returns the pre-clip gradient norm (0-dim, on the device) and whether the
        update was applied."""
        params = weights.load_grads()
        if not params:
            return torch.zeros((), device=self.device), True
        norm = clip_grad_norm(params, self.opt.grad_clip).detach()
        bound = adamw_step_bound(optim).to(self.device)
        counts = torch.stack(
            [
                guard.bad_inputs,
                guard.bad_losses,
                torch.isfinite(norm).logical_not().float(),
                (bound <= _SAFE).logical_not().float(),  # (NaN: not provably safe either)
            ]
        )
        # the ranks' counts summed (a collective every rank runs), so all of them skip together
        counts = self.ranks.sum_rows(counts).cpu()  # one host sync
        if counts[3] and not counts[:3].any():  # near overflow: what would AdamW really do?
            exact = adamw_nonfinite(optim).to(self.device).reshape(1)
            counts[3] = self.ranks.sum_rows(exact).cpu()[0]
        applied = not bool(counts.any())
        if applied:
            optim.step()
            weights.store()
        else:
            why = (guard.what or "loss inputs (on another rank)", "loss", "gradient", _UPDATE)
            self.bad.found[model] = next(w for w, n in zip(why, counts.tolist(), strict=True) if n)
        optim.zero_grad(set_to_none=True)  # free the float32 gradients until the next update
        return norm, applied

    def batch_stats(self, batch: Batch, targets: Targets | None) -> Stats:
        """Reward, length and advantage summaries of the batch."""
        mask = batch.action_mask_BT
        n = mask.sum().clamp(min=1)
        counts = self.bad.stats()
        stats = {k: torch.tensor(float(v), device=self.device) for k, v in counts.items()}
        stats |= {
            "train/reward_mean": batch.rewards_B.mean(),
            "train/action_tokens_mean": mask.sum(dim=1).float().mean(),
            "train/tokens": batch.attention_mask_BT.sum().float(),  # (prompts, observations too)
            "train/truncated_frac": batch.truncated_B.float().mean(),
        }
        if targets is not None:  # (None: a bad step without advantages)
            stats["train/advantage_mean"] = (targets.advantages_BT * mask).sum() / n
            if targets.critic_baseline is not None:  # algo.ev_gate: 1 critic, 0 batch mean
                stats["critic/ev_gate"] = torch.tensor(
                    float(targets.critic_baseline), device=self.device
                )
        if self.critic is not None and self.algo.advantage in CRITIC_ADVANTAGES:
            fit = {k: torch.tensor(v, device=self.device) for k, v in self.fit.stats().items()}
            mc = torch.tensor(float(self.lambda_1), device=self.device)
            stats |= fit | self.gap | {"critic/actor_lambda_1": mc}
        return stats

    def _stateful(self) -> dict[str, _Stateful | None]:
        """Each part of the trainer's state by its checkpoint key (None: not in this run)."""
        return {
            "actor_master": self.actor_weights,
            "critic_master": self.critic_weights,
            "actor_optim": self.actor_optim,
            "critic_optim": self.critic_optim,
            "critic_sched": self.critic_sched,
            "actor_sched": self.actor_sched,
            "running_mean": self.running_mean,
            "critic_fit": self.fit,
        }

    def state_dict(self) -> dict[str, object]:
        """Optimizer, scheduler and baseline state (weights are saved separately)."""
        parts = self._stateful().items()
        return {k: None if v is None else v.state_dict() for k, v in parts} | self.bad.state_dict()

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore what :meth:`state_dict` saved. A part absent from an older checkpoint
        (the masters, the critic's fit) keeps its start: the loaded weights seed the masters."""
        for key, part in self._stateful().items():
            if part is not None and state.get(key) is not None:
                part.load_state_dict(state[key])
        self.bad.load_state_dict(state)


def _zero_loss(out: torch.Tensor) -> torch.Tensor:
    """A zero loss that still reaches every parameter ``out`` depends on: a
    micro-batch without an action token (or a rank's padding micro-batch) runs
    its backward like the others, as FSDP2's collectives require."""
    return out.sum() * 0.0


def _last_action_index(action_mask_BT: torch.Tensor) -> torch.Tensor:
    """Index ``[B]`` of each row's last action token; -1 for a row without one."""
    T = action_mask_BT.shape[1]
    pos = torch.arange(T, device=action_mask_BT.device).expand_as(action_mask_BT)
    return torch.where(action_mask_BT, pos, -1).max(dim=1).values


def to_cpu(stats: Stats) -> Stats:
    """Detached CPU copies of the metrics, made once at the end of the step."""
    return {k: v.detach().cpu() for k, v in stats.items()}
