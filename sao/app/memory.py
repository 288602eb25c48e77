"""A run's expected peak memory, by owner, known before it trains; and the
refusal when it exceeds what the machine has.

The estimate (:func:`estimate_peak`) adds, in bytes:

- the runtime: the resident memory of this process and its children before the
  models were loaded (Python, torch, transformers, the tokenizer; whatever else the
  process already ran), as the run's measured figures count them;
- policy and critic weights, in the model's dtype;
- each trained parameter's optimizer state: AdamW's two float32 moments, and a
  float32 master copy where the model is not float32 (``MasterWeights``);
- the gradients of one model at a time (the trainer frees them after each update);
- the embedded engine's weight copy (``rollout.engine_dtype``) and its KV cache,
  ``2 x layers x rollout.max_batch_size x kv_heads x context x head_dim``;
- the largest training micro-batch's activations: what autograd saves in a
  forward of the backbone at that shape, counted on the "meta" device (shapes
  only, nothing computed; within ~15% of the same count on real tensors for
  SmolLM2-135M), plus the LM head's float32 logits of one checkpointed chunk, held
  three times in its backward. With ``train.activation_checkpointing``: each
  layer's input, and one layer's activations (recomputed in the backward).

The micro-batch is ``train.batch_size`` episodes of the longest an episode can be
(:func:`longest_episode`): the prompt (the longest of a few held-out prompts),
``rollout.max_turns`` replies of ``rollout.max_new_tokens``, and observations up
to ``rollout.max_observation_tokens`` between them, within
``rollout.max_total_tokens``; capped at ``train.token_budget`` tokens. So it is an
upper bound of the step's activations where replies reach their limit, the case a
run must survive. Servers the run launches are not counted; their processes'
memory is measured with the run's. On a GPU (``model.device``) the total is the
device's and is compared with its free memory; the runtime, host memory, is
left out there.

A Ray run on a cluster it starts on this machine (:func:`estimate_ray_peak`)
counts the same owners summed over its processes: the driver, Ray's own, each
rollout worker (its engine, KV cache and the update it receives) and each
trainer rank (its shards and micro-batch), with the copies an update makes on
its way (rank 0's gathered policy, the object store's).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from sao.app.engines import context_window, weight_dtypes
from sao.app.parts import Parts
from sao.config import Config, ConfigError
from sao.envs.base import Task
from sao.models.lora import MergedWeights, has_lora
from sao.rollout.chat import encode_first_observation, validate_observation
from sao.rollout.envthread import EnvCalls
from sao.runtime.memory import GIB, MEMORY_BUSY_EXIT, process_tree_rss

__all__ = [
    "MemoryBusy",
    "MemoryEstimate",
    "check_memory",
    "estimate_peak",
    "estimate_ray_peak",
    "longest_episode",
]

LOGIT_CHUNK = 1024
"""Positions per checkpointed chunk of the trainer's LM head (``sao.models.logprobs``)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Expected peak bytes of a run, by owner, and the micro-batch shape behind them."""

    parts: dict[str, float]
    rows: int
    episode_tokens: int
    processes: int = 1

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        """One line: the total and each owner, in GiB."""
        items = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.parts.items() if v > 0)
        where = f" over {self.processes} processes" if self.processes > 1 else ""
        return (
            f"memory: expected peak {self.total / GIB:.1f} GiB{where} ({items}; a micro-batch "
            f"of {self.rows} x {self.episode_tokens} tokens)"
        )


def _bytes(params: Iterable[nn.Parameter], held: Iterable[nn.Parameter] = ()) -> tuple[int, int]:
    """Bytes of ``params`` and how many of them are trained (``requires_grad``);
    those in ``held`` (counted elsewhere: a LoRA critic's trunk shared with the
    actor's base) are left out."""
    total = trained = 0
    seen: set[int] = {id(p) for p in held}
    for p in params:
        if id(p) in seen:  # tied weights count once
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
        trained += p.numel() if p.requires_grad else 0
    return total, trained


def saved_activation_bytes(policy: PreTrainedModel, rows: int, tokens: int) -> int:
    """Bytes autograd saves in one forward of ``policy``'s backbone on a ``[rows,
    tokens]`` batch, counted on the meta device (a view counts as its base;
    weights are not activations)."""
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(policy.config, dtype=policy.dtype)
    weights = {id(p) for p in shell.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(x: torch.Tensor) -> torch.Tensor:
        nonlocal total
        base = x._base if x._base is not None else x
        if id(base) not in weights and id(base) not in seen:
            seen.add(id(base))
            total += base.numel() * base.element_size()
        return x

    ids = torch.zeros((rows, tokens), dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        shell.base_model(input_ids=ids)
    return total


async def longest_prompt(
    task: Task, tokenizer: PreTrainedTokenizerBase, timeout_s: float, n: int = 8
) -> int | None:
    """Tokens of the longest of the first ``n`` held-out prompts, each reset as the
    agent loop resets it (:class:`~sao.rollout.envthread.EnvCalls`, ``timeout_s``);
    None if one cannot be (an estimate: the episode budget then bounds it)."""
    longest = 0
    for i in range(min(n, task.eval_size)):
        calls = EnvCalls(task.make_env("eval", i))
        try:
            raw = await calls.reset(i, timeout_s)
            obs = validate_observation(raw, vocab_size=len(tokenizer), where="Env.reset")
            longest = max(longest, len(encode_first_observation(tokenizer, obs)[0]))
        except Exception:
            return None
        finally:
            calls.close()
    return longest or None


def longest_episode(cfg: Config, prompt_tokens: int | None, context: int) -> int:
    """The most tokens an episode of this run can hold (module docstring)."""
    r = cfg.rollout
    budget = min(r.max_total_tokens, context)
    if prompt_tokens is None:
        return budget
    observation = r.max_observation_tokens or budget
    longest = prompt_tokens + r.max_turns * r.max_new_tokens + (r.max_turns - 1) * observation
    return min(budget, longest)


def estimate_peak(p: Parts, prompt_tokens: int | None, runtime: int) -> MemoryEstimate:
    """The expected peak of a local run of ``p`` on its device (module docstring);
    ``runtime``: the process's resident bytes before it loaded the models (counted
    on the CPU only)."""
    cfg, policy = p.cfg, p.policy
    on_host = p.device.type == "cpu"
    policy_bytes, policy_trained = _bytes(policy.parameters())
    critic_bytes, critic_trained = (
        (0, 0) if p.critic is None else _bytes(p.critic.parameters(), policy.parameters())
    )
    master = 0 if policy.dtype == torch.float32 else 4
    parts: dict[str, float] = {
        "runtime": runtime if on_host else 0,  # (the device's memory holds no Python)
        "policy": policy_bytes,
        "critic": critic_bytes,
        "optimizer": (8 + master) * (policy_trained + critic_trained),
        "gradients": (policy.dtype.itemsize + master) * max(policy_trained, critic_trained),
    }
    context = context_window(policy, cfg.rollout.max_total_tokens)
    if cfg.rollout.engine == "torch":
        plain = _plain_bytes(policy, policy_bytes, policy_trained)
        parts["engine"], parts["kv_cache"] = _engine_bytes(cfg, policy, plain, context)
    episode = longest_episode(cfg, prompt_tokens, context)
    rows = max(1, min(cfg.train.batch_size, cfg.train.token_budget // episode))
    parts["activations"] = _activation_bytes(cfg, policy, rows, episode)
    return MemoryEstimate(parts, rows, episode)


RAY_DAEMONS = 0.4 * GIB
"""Memory of a local Ray cluster's own processes (GCS server, raylet, dashboard,
its agents and helpers), as the run reads them (proportional shares: libraries
they map with the run's other processes count once): 0.37 GiB measured beside a
run on a 2-core machine (their resident memory, each library counted in each
process, 0.56 GiB; BENCHMARKS.md, "A Ray run's memory")."""
RAY_ACTOR = 0.45 * GIB
"""A Ray actor process's runtime before its models (a rollout worker, a trainer
rank): Python, torch, transformers, sao, Ray's core worker and its threads, gloo,
as a proportional share: 0.41 GiB measured for a rollout worker holding a
1M-parameter model (its resident memory 0.54-0.55 GiB; the same section). A
constant, not the driver's runtime: a driver may hold what its actors never load
(a test runner, a notebook)."""


def estimate_ray_peak(
    cfg: Config,
    policy: PreTrainedModel,
    critic: nn.Module | None,
    prompt_tokens: int | None,
    runtime: int,
) -> MemoryEstimate:
    """The expected peak host memory of a run with ``runtime.backend = "ray"`` on a
    cluster started on this machine, summed over its processes: the driver
    (``runtime``, its figure before models) and Ray's own (``processes``:
    :data:`RAY_DAEMONS`, and :data:`RAY_ACTOR` for each actor's runtime); the
    trainer ranks' model shards, which add up to one copy of each model, its
    optimizer state and gradients (both models' at once when the critic has ranks
    of its own), and each rank's micro-batch of ``train.batch_size / ranks`` rows;
    rank 0's gathered copy of the policy and the update in the object store (the
    policy, or a LoRA policy's merged adapted modules); and each rollout worker's
    engine copy and KV cache (a worker maps the update from the object store
    without copying it: :mod:`sao.distributed.shared`). ``policy`` and
    ``critic``: the models as the ranks build them, on the "meta" device (shapes
    only)."""
    rt = cfg.runtime
    share = rt.trainer_ranks == 1 and rt.critic_ranks == 0  # (one process: a shared trunk)
    policy_bytes, policy_trained = _bytes(policy.parameters())
    critic_bytes, critic_trained = (
        (0, 0)
        if critic is None
        else _bytes(critic.parameters(), policy.parameters() if share else ())
    )
    master = 0 if policy.dtype == torch.float32 else 4
    at_once = critic_trained if rt.critic_ranks else 0  # (else the critic's come and go first)
    actors = rt.rollout_workers + rt.trainer_ranks + rt.critic_ranks
    update = _update_bytes(policy, policy_bytes)
    parts: dict[str, float] = {
        "runtime": runtime,
        "processes": RAY_DAEMONS + actors * RAY_ACTOR,
        "policy": 2 * policy_bytes + update,  # shards, rank 0's gathered copy, the update
        "critic": critic_bytes,
        "optimizer": (8 + master) * (policy_trained + critic_trained),
        "gradients": (policy.dtype.itemsize + master)
        * (max(policy_trained, critic_trained) if not at_once else policy_trained + at_once),
    }
    context = context_window(policy, cfg.rollout.max_total_tokens)
    if cfg.rollout.engine == "torch":
        plain = _plain_bytes(policy, policy_bytes, policy_trained)
        engine, kv = _engine_bytes(cfg, policy, plain, context)
        parts["engine"] = rt.rollout_workers * engine
        parts["kv_cache"] = rt.rollout_workers * kv
    episode = longest_episode(cfg, prompt_tokens, context)
    share_rows = math.ceil(cfg.train.batch_size / rt.trainer_ranks)
    rows = max(1, min(share_rows, cfg.train.token_budget // episode))
    activations = rt.trainer_ranks * _activation_bytes(cfg, policy, rows, episode)
    if critic is not None and rt.critic_ranks:  # its K updates run while the actor's does
        critic_rows = math.ceil(cfg.train.batch_size / rt.critic_ranks)
        critic_rows = max(1, min(critic_rows, cfg.train.token_budget // episode))
        activations += rt.critic_ranks * _activation_bytes(
            cfg, policy, critic_rows, episode, logits=False
        )
    parts["activations"] = activations
    return MemoryEstimate(parts, rows, episode, processes=1 + actors)


def _plain_bytes(policy: PreTrainedModel, policy_bytes: int, trained: int) -> int:
    """The policy's bytes without its adapters (what an engine's merged copy holds:
    a LoRA policy trains only those)."""
    return policy_bytes - (trained * policy.dtype.itemsize if has_lora(policy) else 0)


def _update_bytes(policy: PreTrainedModel, policy_bytes: int) -> int:
    """What one weight update carries: the whole policy, or for a LoRA policy its
    adapted modules' merged weights (:func:`~sao.models.lora.published_state`)."""
    if not has_lora(policy):
        return policy_bytes
    shapes = MergedWeights(policy).shapes.values()
    return sum(math.prod(shape) for shape in shapes) * policy.dtype.itemsize


def _engine_bytes(
    cfg: Config, policy: PreTrainedModel, policy_bytes: int, context: int
) -> tuple[float, float]:
    """The embedded engine's weight copy (of ``policy_bytes`` in the model's dtype)
    and its KV cache, in bytes."""
    c = policy.config
    engine_dtype = weight_dtypes(cfg, policy)[1]
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv = 2 * c.num_hidden_layers * cfg.rollout.max_batch_size * kv_heads * context * head_dim
    return policy_bytes * engine_dtype.itemsize / policy.dtype.itemsize, kv * engine_dtype.itemsize


def _activation_bytes(
    cfg: Config, policy: PreTrainedModel, rows: int, episode: int, *, logits: bool = True
) -> int:
    """A training micro-batch's saved activations (``rows`` x ``episode`` tokens),
    and the LM head's logits (``logits``; a critic has none)."""
    c = policy.config
    tokens = rows * episode
    saved = saved_activation_bytes(policy, rows, episode)
    if cfg.train.activation_checkpointing:  # each layer's input, and one layer recomputed
        inputs = c.num_hidden_layers * tokens * c.hidden_size * policy.dtype.itemsize
        saved = saved // c.num_hidden_layers + inputs
    return saved + (3 * min(tokens, LOGIT_CHUNK) * c.vocab_size * 4 if logits else 0)


def available_bytes(device: torch.device) -> float | None:
    """The memory this run may have in all (None where unknown): on the CPU, Linux's
    ``MemAvailable`` plus what this process and its children already hold; on a GPU,
    its free memory plus what torch already holds there."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free + torch.cuda.memory_reserved(device))
    if device.type != "cpu":
        return None
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    kib = {ln.split(":")[0]: int(ln.split()[1]) for ln in lines if ln.endswith("kB")}
    if "MemAvailable" not in kib:
        return None
    return kib["MemAvailable"] * 1024.0 + sum(process_tree_rss())


_LEVERS = {
    "activations": (
        "train.token_budget (smaller micro-batches), rollout.max_total_tokens, "
        "train.activation_checkpointing=true"
    ),
    "kv_cache": "rollout.max_batch_size (decode slots), rollout.max_total_tokens",
    "engine": 'rollout.engine_dtype="bfloat16" (half the engine copy)',
    "optimizer": "algo.critic_train_layers (train the critic's top layers only)",
    "gradients": "algo.critic_train_layers",
    "critic": "a critic-free algo.preset (grpo, rloo, running_mean)",
    "policy": 'model.dtype="bfloat16"',
    "runtime": "",
    "processes": "runtime.rollout_workers, runtime.trainer_ranks (each a process of its own)",
}


class MemoryBusy(ConfigError):
    """The run fits the machine alone, but not beside the runs that ``sao experiment
    --jobs`` started before it: the runner starts it again when one of them ends."""

    exit_code = MEMORY_BUSY_EXIT


def check_memory(
    estimate: MemoryEstimate, available: float | None, *, enforce: bool, reserved: float = 0.0
) -> str:
    """The estimate's line (with the memory available); a ConfigError naming the
    keys that lower the largest owners when it exceeds what is available (and
    ``enforce``, ``train.memory_check``); :class:`MemoryBusy` when it fits only
    without the ``reserved`` bytes that the runs beside it will still claim."""
    line = estimate.describe()
    if available is None or not math.isfinite(available):
        return line
    line += f"; {available / GIB:.1f} GiB available"
    if reserved > 0:
        line += f", {reserved / GIB:.1f} GiB of it claimed by the runs beside this one"
    if estimate.total <= available - reserved or not enforce:
        return line
    if estimate.total <= available:
        raise MemoryBusy(
            f"this run is expected to need {estimate.total / GIB:.1f} GiB at its peak: "
            f"{available / GIB:.1f} GiB are available, but the runs beside it will still "
            f"claim {reserved / GIB:.1f} GiB of them; it waits until one of them ends"
        )
    owners = sorted((k for k in estimate.parts if _LEVERS[k]), key=lambda k: -estimate.parts[k])
    levers = [f"{k} ({estimate.parts[k] / GIB:.2f} GiB): {_LEVERS[k]}" for k in owners]
    raise ConfigError(
        f"this run is expected to need {estimate.total / GIB:.1f} GiB at its peak, more than the "
        f"{available / GIB:.1f} GiB available. "
        + line
        + ". Lower the largest owners: "
        + "; ".join(levers[:4])
        + ". Or set train.memory_check=false to start it anyway"
    )
