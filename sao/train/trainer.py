"""One trainer step: critic forward, advantages, K critic updates with frozen
attention, the actor update. ``Trainer.step`` reads as the algorithm.

Device: every tensor the step builds lives on the policy's device (the batch is
collated on the CPU, then moved once); the returned metrics are CPU tensors.
Precision: the optimizers step float32 master weights
(:class:`~sao.train.precision.MasterWeights`), whatever the models' dtype.
Ranks: the :class:`~sao.train.sharded.RankContext` builds the models (FSDP2 with
N ranks) and picks this rank's micro-batches; every quantity that is not
row-local (denominators, advantages, statistics) comes from the whole batch, so
the step is the same code on one rank or many (sao/train/sharded.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from sao.algo.baselines import RunningMeanBaseline, overlong_penalty
from sao.algo.losses import aggregate_denom, value_loss
from sao.algo.presets import AlgoPreset
from sao.models.value import ValueModel
from sao.train.estimators import Stats, Targets, compute_targets, needs_old_logp, policy_loss
from sao.train.precision import MasterWeights
from sao.train.sharded import PolicyLogprobs, RankContext, clip_grad_norm
from sao.types import Batch, Trajectory, collate


@dataclass(frozen=True)
class OptimSettings:
    """Optimisation knobs the trainer needs (from ``TrainConfig``)."""

    actor_lr: float = 2e-4
    critic_lr: float = 1e-3
    critic_lr_warmup_steps: int = 10
    grad_clip: float = 1.0
    token_budget: int = 8192
    max_bad_steps: int = 3
    temperature: float = 1.0
    max_action_tokens: int = 256


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a NaN/inf loss or gradient."""


class Trainer:
    """Actor (policy) and critic updates for one algorithm preset."""

    def __init__(
        self,
        policy: PreTrainedModel,
        critic: ValueModel | None,
        algo: AlgoPreset,
        settings: OptimSettings,
        ranks: RankContext | None = None,
    ) -> None:
        self.policy, self.critic, self.algo, self.opt = policy, critic, algo, settings
        self.ranks = RankContext() if ranks is None else ranks
        # FSDP2 with N ranks (before the optimizers: parameters become DTensors); as is on one
        self.actor = self.ranks.shard(PolicyLogprobs(policy, settings.temperature))
        if critic is not None:
            self.ranks.shard(critic)
        self.device = next(policy.parameters()).device
        self.actor_weights = MasterWeights(policy.parameters())
        self.actor_optim = torch.optim.AdamW(self.actor_weights.params, lr=settings.actor_lr)
        self.critic_weights: MasterWeights | None = None
        self.critic_optim: torch.optim.Optimizer | None = None
        self.critic_sched: torch.optim.lr_scheduler.LRScheduler | None = None
        if critic is not None:
            self.critic_weights = MasterWeights(p for p in critic.parameters() if p.requires_grad)
            self.critic_optim = torch.optim.AdamW(self.critic_weights.params, lr=settings.critic_lr)
            warm = max(settings.critic_lr_warmup_steps, 1)
            self.critic_sched = torch.optim.lr_scheduler.LambdaLR(
                self.critic_optim, lambda s: min(1.0, (s + 1) / warm)
            )
        self.running_mean = (
            RunningMeanBaseline(algo.running_mean_window, algo.running_mean_per_prompt)
            if algo.advantage == "running_mean"
            else None
        )
        self.bad_steps = 0
        self.skipped_steps = 0
        self._finite = True

    # ------------------------------------------------------------------ the step

    def step(self, trajectories: Sequence[Trajectory], *, train_actor: bool = True) -> Stats:
        """One actor step (or a critic-only warm-up step) on finished trajectories."""
        self._finite = True  # set False by any skipped (NaN/inf) optimizer update
        batch = self.prepare(trajectories)
        values_BT = self.values(batch)
        targets = compute_targets(self.algo, batch, values_BT, self.running_mean)
        stats: Stats = {}
        if self.critic is not None and targets.returns_BT is not None:
            stats |= self.update_critic(batch, targets, values_BT)
            if self.algo.advantages_after_critic_update and train_actor:
                targets = compute_targets(self.algo, batch, self.values(batch), None)
        if train_actor:
            stats |= self.update_actor(batch, targets.advantages_BT)
        self._count_bad_step()
        return _to_cpu(stats | self.batch_stats(batch, targets))

    # ------------------------------------------------------------------ phases

    def prepare(self, trajectories: Sequence[Trajectory]) -> Batch:
        """Collate onto the policy's device; drop truncated rows if asked; apply
        DAPO's overlong shaping."""
        trajs = list(trajectories)
        if self.algo.truncation == "drop":
            trajs = [t for t in trajs if not t.truncated] or trajs
        batch = collate(trajs).to(self.device)
        if self.algo.overlong_penalty:
            lengths_B = batch.action_mask_BT.sum(dim=1)
            cache = max(self.opt.max_action_tokens // 4, 1)
            pen_B = overlong_penalty(lengths_B, max_len=self.opt.max_action_tokens, cache_len=cache)
            last_B = _last_action_index(batch.action_mask_BT)
            rows = torch.arange(batch.size, device=self.device)[last_B >= 0]
            batch.rewards_BT[rows, last_B[rows]] += pen_B[rows].to(batch.rewards_BT.dtype)
            batch.rewards_B.add_(pen_B.to(batch.rewards_B.dtype))
        return batch

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor | None:
        """Critic values ``[B, T]`` for the whole batch (no gradient), or None."""
        if self.critic is None:
            return None
        out = batch.rollout_logp_BT.new_zeros(batch.tokens_BT.shape, dtype=torch.float32)
        for mb, rows in self._with_rows(batch):
            v = self.critic(mb.tokens_BT, mb.attention_mask_BT).float()
            out[rows, : v.shape[1]] = v
        return self.ranks.sum_rows(out)  # each row was filled by one rank

    def update_critic(
        self, batch: Batch, targets: Targets, old_values_BT: torch.Tensor | None = None
    ) -> Stats:
        """K critic optimizer steps on fixed lam=1 targets (paper section 4);
        ``old_values_BT`` (values before the update) anchor optional value clipping."""
        assert self.critic is not None and self.critic_weights is not None
        assert self.critic_optim is not None
        assert targets.returns_BT is not None and targets.critic_mask_BT is not None
        mask = targets.critic_mask_BT
        denom = aggregate_denom(mask) if bool(mask.any()) else 1.0
        stats: Stats = {}
        for _ in range(self.algo.critic_steps):
            self.critic_optim.zero_grad(set_to_none=True)
            for mb, rows in self._with_rows(batch):
                T = mb.tokens_BT.shape[1]
                m = mask[rows, :T]
                v = self.critic(mb.tokens_BT, mb.attention_mask_BT)
                if not bool(m.any()):  # still a backward: ranks run the same passes
                    _zero_loss(v).backward()
                    continue
                clip = self.algo.value_clip if old_values_BT is not None else None
                old = None if clip is None else old_values_BT[rows, :T]  # type: ignore[index]
                loss, _ = value_loss(
                    v,
                    targets.returns_BT[rows, :T],
                    m,
                    denom=denom,
                    old_values_BT=old,
                    clip_eps=clip,
                )
                loss.backward()
            norm = self._apply(self.critic_weights, self.critic_optim)
            if self.critic_sched is not None:
                self.critic_sched.step()
            stats = {"critic/grad_norm": norm}
        values_BT = self.values(batch)
        assert values_BT is not None
        if bool(mask.any()):  # the critic after its K steps, on this batch
            stats |= value_loss(values_BT, targets.returns_BT, mask)[1]
        return stats

    def update_actor(self, batch: Batch, advantages_BT: torch.Tensor) -> Stats:
        """One actor optimizer step over micro-batches (gradients accumulate
        exactly); the loss statistics come from the whole batch's log-probs."""
        mask = batch.action_mask_BT
        reduction = "seq_mean_token_mean" if self.algo.loss == "gspo" else self.algo.reduction
        denom = aggregate_denom(mask, reduction)
        old = self._old_logp(batch) if needs_old_logp(self.algo) else None
        self.actor_optim.zero_grad(set_to_none=True)
        logp_BT = torch.zeros_like(batch.rollout_logp_BT, dtype=torch.float32)
        for mb, rows in self._with_rows(batch):
            T = mb.tokens_BT.shape[1]
            logp = self.actor(mb.tokens_BT, mb.attention_mask_BT)
            logp_BT[rows, :T] = logp.detach()
            if not bool(mb.action_mask_BT.any()):  # still a backward: ranks run the same passes
                _zero_loss(logp).backward()
                continue
            old_mb = None if old is None else old[rows, :T]
            args = (mb.rollout_logp_BT, old_mb, advantages_BT[rows, :T], mb.action_mask_BT)
            loss, _ = policy_loss(self.algo, logp, *args, denom)
            loss.backward()
        norm = self._apply(self.actor_weights, self.actor_optim)
        logp_BT = self.ranks.sum_rows(logp_BT)
        with torch.no_grad():  # whole-batch statistics, the same on every rank
            loss, stats = policy_loss(
                self.algo, logp_BT, batch.rollout_logp_BT, old, advantages_BT, mask, denom
            )
        return stats | {"actor/loss": loss, "actor/grad_norm": norm}

    # ------------------------------------------------------------------ helpers

    @torch.no_grad()
    def _old_logp(self, batch: Batch) -> torch.Tensor:
        out = batch.rollout_logp_BT.new_zeros(batch.tokens_BT.shape, dtype=torch.float32)
        for mb, rows in self._with_rows(batch):
            lp = self.actor(mb.tokens_BT, mb.attention_mask_BT)
            out[rows, : lp.shape[1]] = lp
        return self.ranks.sum_rows(out)

    def _with_rows(self, batch: Batch) -> Iterator[tuple[Batch, torch.Tensor]]:
        return self.ranks.micro_batches(batch, self.opt.token_budget)

    def _apply(self, weights: MasterWeights, optim: torch.optim.Optimizer) -> torch.Tensor:
        """Clip, guard against NaN/inf, step the float32 masters and write them
        back into the model. Returns the pre-clip gradient norm (0-dim, on the device)."""
        params = weights.load_grads()
        if not params:
            return torch.zeros((), device=self.device)
        norm = clip_grad_norm(params, self.opt.grad_clip).detach()
        finite = math.isfinite(float(norm))  # one host sync per optimizer step
        self._finite &= finite
        if finite:
            optim.step()
            weights.store()
        optim.zero_grad(set_to_none=True)  # free the float32 gradients until the next update
        return norm

    def _count_bad_step(self) -> None:
        """Count a step whose actor or critic update was skipped; stop after
        ``max_bad_steps`` such steps in a row (one good update of the critic
        must not hide a diverged actor, so this is counted per trainer step)."""
        if self._finite:
            self.bad_steps = 0
            return
        self.bad_steps += 1
        self.skipped_steps += 1
        if self.bad_steps >= self.opt.max_bad_steps:
            raise NonFiniteError(
                f"{self.bad_steps} consecutive steps had a NaN/inf loss or gradient; stopping "
                "(lower the learning rates, or raise train.max_bad_steps)"
            )

    def batch_stats(self, batch: Batch, targets: Targets) -> Stats:
        """Reward, length and advantage summaries of the batch."""
        mask = batch.action_mask_BT
        n = mask.sum().clamp(min=1)
        return {
            "train/reward_mean": batch.rewards_B.mean(),
            "train/action_tokens_mean": mask.sum(dim=1).float().mean(),
            "train/advantage_mean": (targets.advantages_BT * mask).sum() / n,
            "train/truncated_frac": batch.truncated_B.float().mean(),
            "train/skipped_steps": torch.tensor(float(self.skipped_steps), device=self.device),
        }

    def state_dict(self) -> dict[str, object]:
        """Optimizer, scheduler and baseline state (weights are saved separately)."""
        critic_master = None if self.critic_weights is None else self.critic_weights.state_dict()
        return {
            "actor_master": self.actor_weights.state_dict(),
            "critic_master": critic_master,
            "actor_optim": self.actor_optim.state_dict(),
            "critic_optim": None if self.critic_optim is None else self.critic_optim.state_dict(),
            "critic_sched": None if self.critic_sched is None else self.critic_sched.state_dict(),
            "running_mean": None if self.running_mean is None else self.running_mean.state_dict(),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore what :meth:`state_dict` saved."""
        # masters: absent from checkpoints written before them (the loaded weights then seed them)
        if state.get("actor_master") is not None:
            self.actor_weights.load_state_dict(state["actor_master"])  # type: ignore[arg-type]
        if self.critic_weights is not None and state.get("critic_master") is not None:
            self.critic_weights.load_state_dict(state["critic_master"])  # type: ignore[arg-type]
        self.actor_optim.load_state_dict(state["actor_optim"])  # type: ignore[arg-type]
        if self.critic_optim is not None and state.get("critic_optim") is not None:
            self.critic_optim.load_state_dict(state["critic_optim"])  # type: ignore[arg-type]
        if self.critic_sched is not None and state.get("critic_sched") is not None:
            self.critic_sched.load_state_dict(state["critic_sched"])  # type: ignore[arg-type]
        if self.running_mean is not None and state.get("running_mean") is not None:
            self.running_mean.load_state_dict(state["running_mean"])  # type: ignore[arg-type]
        self.skipped_steps = int(state.get("skipped_steps", 0))  # type: ignore[call-overload]


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


def _to_cpu(stats: Stats) -> Stats:
    """Detached CPU copies of the metrics, made once at the end of the step."""
    return {k: v.detach().cpu() for k, v in stats.items()}
