"""What a run is made of, built from a :class:`~sao.config.Config`: the task,
the tokenizer, the policy and critic to train, the trainer and the episode
limits (:func:`build_parts`), and the pieces each builder uses on its own
(a trainer rank of the Ray backend loads only the model it trains)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sao.agents.runner import AgentTask
from sao.app.warmstart import ensure_policy
from sao.config import Config, ConfigError
from sao.envs.base import Task
from sao.envs.latency import LatencyWrapper
from sao.envs.registry import make_task
from sao.models.checkpointing import checkpoint_layers
from sao.models.fetch import resolve_model_path
from sao.models.freeze import freeze_attention, freeze_below
from sao.models.loading import (
    DeviceError,
    load_policy,
    load_tokenizer,
    policy_shell,
    resolve_device,
    resolve_dtype,
)
from sao.models.lora import add_lora, has_lora, load_adapter, share_frozen_base
from sao.models.value import ValueModel
from sao.rollout.agent import EpisodeLimits
from sao.runtime.orchestrator import FailurePolicy
from sao.train.sharded import RankContext
from sao.train.trainer import OptimSettings, Trainer
from sao.types import SamplingParams

TrainTask = Task | AgentTask
"""What ``train`` trains on: an environment task, or your own agent."""


@dataclass
class Parts:
    """Everything a run is made of."""

    cfg: Config
    task: TrainTask
    tokenizer: PreTrainedTokenizerBase
    policy: PreTrainedModel
    critic: ValueModel | None
    trainer: Trainer | None
    """None for the driver of Ray trainer ranks (they build their own)."""
    sampling: SamplingParams
    limits: EpisodeLimits
    device: torch.device = torch.device("cpu")  # noqa: RUF009 (immutable)
    """Where policy and critic live (``model.device`` resolved); the engine's place too."""


def build_task(cfg: Config) -> Task:
    """The configured task, behind simulated latency if asked."""
    try:
        task = make_task(cfg.task.name, **{"seed": cfg.seed, **cfg.task.options})
    except (TypeError, ValueError) as e:  # an unknown option, or a bad value for one
        raise ConfigError(f"task.options: {e}") from None
    if cfg.task.latency != "none":
        task = LatencyWrapper(
            task,
            distribution=cfg.task.latency,
            median_s=cfg.task.latency_median_s,
            sigma=cfg.task.latency_sigma,
            max_s=cfg.task.latency_max_s,
            seed=cfg.seed,
        )
    return task


def build_limits(cfg: Config) -> EpisodeLimits:
    """The agent loop's per-episode limits from ``cfg.rollout``."""
    r = cfg.rollout
    return EpisodeLimits(
        max_turns=r.max_turns,
        max_total_tokens=r.max_total_tokens,
        step_timeout_s=r.step_timeout_s,
        reset_timeout_s=r.step_timeout_s,
        max_observation_tokens=r.max_observation_tokens,
        tito_check=r.tito_check,
    )


def build_failure_policy(cfg: Config) -> FailurePolicy:
    """What failed episodes become, and when the run stops (``rollout``, ``runtime``)."""
    reward = cfg.rollout.failure_reward
    return FailurePolicy(
        reward=None if reward == "drop" else float(reward),
        max_in_a_row=cfg.rollout.max_failures_in_a_row,
        watchdog_s=cfg.runtime.watchdog_s,
    )


def policy_path(cfg: Config) -> Path:
    """The configured checkpoint (a ``.gguf`` file: its imported directory), or
    the task's cached tiny warm-started policy."""
    if cfg.model.path is not None:
        return resolve_model_path(cfg.model.path)
    options = {"seed": cfg.seed, **cfg.task.options}
    return ensure_policy(cfg.task.name, options, size=cfg.model.tiny_size, seed=cfg.seed)


def build_parts(
    cfg: Config,
    start_dir: Path | None = None,
    task: TrainTask | None = None,
    *,
    ranks: RankContext | None = None,
    quiet: bool = False,
    models: bool = True,
) -> Parts:
    """Load models and build the trainer. ``start_dir`` overrides the policy
    (resume); ``task`` replaces the configured built-in task (your own env);
    ``ranks`` makes this one rank of a sharded trainer (``quiet``: print nothing).
    ``models=False``: the driver of Ray trainer ranks, which load what they
    train: the policy is a weightless "meta" shell (config, names, dtypes), and
    there is no critic and no trainer."""
    device, dtype = model_device(cfg)
    if task is None:
        task = build_task(cfg)
    elif cfg.model.path is None:
        raise ConfigError("training your own task needs model.path (a local checkpoint)")
    tokenizer = load_tokenizer(policy_path(cfg))
    if not models:
        # (a LoRA checkpoint's policy/ is an adapter: the shell is its base)
        saved = start_dir / "policy" if start_dir and cfg.model.lora is None else None
        shell = policy_shell(saved or policy_path(cfg), dtype=dtype)
        sampling = sampling_params(cfg)
        return Parts(cfg, task, tokenizer, shell, None, None, sampling, build_limits(cfg), device)
    policy = load_trained_policy(cfg, start_dir, device, dtype)
    critic = load_critic(cfg, start_dir, device, dtype, quiet=quiet, share_with=policy)
    if cfg.train.activation_checkpointing:  # (the engine's deep copy only runs without grad)
        for model in (policy, critic):
            if model is not None:
                checkpoint_layers(model)
    trainer = Trainer(policy, critic, cfg.algo.resolve(), optim_settings(cfg), ranks)
    sampling = sampling_params(cfg)
    return Parts(cfg, task, tokenizer, policy, critic, trainer, sampling, build_limits(cfg), device)


def sampling_params(cfg: Config) -> SamplingParams:
    """The run's sampling settings (``rollout.*``)."""
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens
    )


def model_device(cfg: Config) -> tuple[torch.device, torch.dtype]:
    """``model.device`` and ``model.dtype`` resolved (a ConfigError when unusable)."""
    try:
        device = resolve_device(cfg.model.device)
        return device, resolve_dtype(cfg.model.dtype, device)
    except DeviceError as e:
        raise ConfigError(str(e)) from None


def load_trained_policy(
    cfg: Config, start_dir: Path | None, device: torch.device, dtype: torch.dtype
) -> PreTrainedModel:
    """The policy to train: the checkpoint's (``start_dir``) or the configured one;
    with ``model.lora``, the configured base with a new adapter (or the checkpoint's)."""
    lora = cfg.model.lora
    if lora is None:
        return load_policy(
            start_dir / "policy" if start_dir else policy_path(cfg), dtype=dtype, device=device
        )
    base = policy_path(cfg)
    policy = load_policy(base, dtype=dtype, device=device)
    try:
        add_lora(
            policy, rank=lora.rank, alpha=lora.alpha, targets=lora.target_modules, seed=cfg.seed
        )
        if start_dir is not None:
            load_adapter(policy, start_dir / "policy", base)
    except ValueError as e:
        raise ConfigError(f"model.lora: {e}") from None
    return policy


def load_critic(
    cfg: Config,
    start_dir: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    *,
    quiet: bool = False,
    share_with: PreTrainedModel | None = None,
) -> ValueModel | None:
    """The critic to train (None for an algorithm without one): the checkpoint's,
    or a new value head on ``model.critic_path`` (default: the policy), its
    attention frozen when the preset says so. ``share_with``: the policy, whose
    frozen base a LoRA critic on the same checkpoint shares with a LoRA actor."""
    algo = cfg.algo.resolve()
    if not algo.use_critic:
        return None
    if cfg.model.critic_lora is not None:
        return _lora_critic(cfg, start_dir, device, dtype, quiet=quiet, share_with=share_with)
    if start_dir is not None and (start_dir / "critic").is_dir():
        critic = ValueModel.from_pretrained(start_dir / "critic", dtype=dtype, device=device)
    else:
        critic = ValueModel.from_policy(
            critic_base(cfg),
            dtype=dtype,
            device=device,
            seed=cfg.seed,
            head_init=algo.value_head_init,
        )
    if algo.freeze_critic_attention:
        report = freeze_attention(critic)  # before the optimizer is built (paper section 4)
        if not quiet:
            print(
                f"critic attention frozen: {report.num_frozen:,} parameters frozen, "
                f"{report.num_trainable:,} trainable"
            )
    if algo.critic_train_layers is not None:
        try:
            report = freeze_below(critic, algo.critic_train_layers)
        except ValueError as e:
            raise ConfigError(f"algo.critic_train_layers: {e}") from None
        if not quiet:
            print(
                f"critic trains its top {algo.critic_train_layers} layers only: "
                f"{report.num_trainable:,} parameters trainable, {report.num_frozen:,} frozen"
            )
    return critic


def model_shells(cfg: Config) -> tuple[PreTrainedModel, ValueModel | None]:
    """The policy and the critic as Ray trainer ranks build them, on the "meta"
    device: shapes, dtypes and which parameters train, no weights read."""
    _, dtype = model_device(cfg)
    meta = torch.device("meta")
    policy = load_trained_policy(cfg, None, meta, dtype)
    share = policy if cfg.runtime.trainer_ranks == 1 and cfg.runtime.critic_ranks == 0 else None
    return policy, load_critic(cfg, None, meta, dtype, quiet=True, share_with=share)


def critic_base(cfg: Config) -> Path:
    """The checkpoint a new critic starts from: ``model.critic_path``, else the policy's."""
    return resolve_model_path(cfg.model.critic_path) if cfg.model.critic_path else policy_path(cfg)


def _lora_critic(
    cfg: Config,
    start_dir: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    *,
    quiet: bool,
    share_with: PreTrainedModel | None,
) -> ValueModel:
    """A critic with LoRA on its backbone (``model.critic_lora``): the value head and
    the final norm train fully; with frozen attention the adapters skip attention.
    Beside a LoRA actor on the same checkpoint, its frozen trunk is the actor's
    frozen base (one copy in memory, not two)."""
    algo, lora = cfg.algo.resolve(), cfg.model.critic_lora
    assert lora is not None
    base = critic_base(cfg)
    critic = ValueModel.from_policy(
        base, dtype=dtype, device=device, seed=cfg.seed, head_init=algo.value_head_init
    )
    try:
        report = add_lora(
            critic.backbone,
            rank=lora.rank,
            alpha=lora.alpha,
            targets=lora.target_modules,
            skip_attention=algo.freeze_critic_attention,
            train_final_norm=True,
            seed=cfg.seed + 1,
        )
        if start_dir is not None and (start_dir / "critic").is_dir():
            critic.load_lora(start_dir / "critic", base)
        if algo.critic_train_layers is not None:
            freeze_below(critic, algo.critic_train_layers)
    except ValueError as e:
        raise ConfigError(f"model.critic_lora: {e}") from None
    shared = 0
    if share_with is not None and has_lora(share_with) and cfg.model.critic_path is None:
        shared = share_frozen_base(critic.backbone, share_with)
    if not quiet:
        frozen = ", attention left out (frozen)" if algo.freeze_critic_attention else ""
        trunk = (
            f"; its frozen trunk is the actor's base ({shared / 2**30:.2f} GiB)" if shared else ""
        )
        print(f"critic LoRA: {report.describe()}{frozen}{trunk if shared else ''}")
    return critic


def optim_settings(cfg: Config) -> OptimSettings:
    """The trainer's optimisation knobs from the config."""
    r, t = cfg.rollout, cfg.train
    return OptimSettings(
        actor_lr=t.actor_lr,
        critic_lr=t.critic_lr,
        critic_lr_warmup_steps=t.critic_lr_warmup_steps,
        actor_lr_warmup_steps=t.actor_lr_warmup_steps,
        grad_clip=t.grad_clip,
        token_budget=t.token_budget,
        max_bad_steps=t.max_bad_steps,
        temperature=r.temperature,
        max_action_tokens=r.max_turns * r.max_new_tokens,
        packing=t.packing,
    )
