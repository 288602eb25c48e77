"""Shared by the sharded-trainer tests: a deterministic batch, a trainer, one
scenario (two steps, optionally through a DCP checkpoint), and the entry point
of a spawned rank. Every rank and the single-process reference build exactly
the same objects from the same seeds."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from sao.algo.presets import AlgoPreset, get_preset
from sao.models.freeze import freeze_attention
from sao.models.logprobs import sequence_logprobs
from sao.models.tiny import build_tiny_policy
from sao.models.tokenization import build_char_tokenizer
from sao.models.value import ValueModel
from sao.train.sharded import RankContext, full_state_dict, init_trainer_group
from sao.train.sharded_checkpoint import load_sharded, save_pretrained_gathered, save_sharded
from sao.train.trainer import OptimSettings, Trainer
from sao.types import Trajectory, Turn

TOK = build_char_tokenizer(alphabet="ab\n")
# token_budget 40 with rows of 6-24 tokens: 2-5 micro-batches per rank;
# grad_clip 0.1: the clip is active, so the sharded norm is exercised
SETTINGS = OptimSettings(
    actor_lr=1e-3, critic_lr=1e-3, critic_lr_warmup_steps=3, grad_clip=0.1, token_budget=40
)
ALGOS: dict[str, AlgoPreset] = {
    # critic, K=2, frozen attention, token mean, whitening over the whole batch
    "sao": get_preset("sao").with_(whiten_advantages=True),
    # group baselines (4 per group), PPO clip against the old-policy pass
    "grpo": get_preset("grpo").with_(group_size=4),
    # sequence-mean reduction (denominator: rows)
    "gspo": get_preset("gspo").with_(group_size=4),
}
# grpo: 3 groups on 2 ranks, so one rank runs a padding micro-batch
ROWS = {"sao": 16, "grpo": 12, "gspo": 16}
Result = dict[str, dict[str, torch.Tensor]]


def make_batch(seed: int, rows: int = 16, group_size: int = 4) -> list[Trajectory]:
    """``rows`` multi-turn episodes of random lengths (6-24 tokens), groups of
    ``group_size`` consecutive rows, rollout log-probs = the initial policy's
    plus noise (so the DIS / PPO bands drop some tokens)."""
    g = torch.Generator().manual_seed(seed)
    policy = build_tiny_policy(TOK, size="0.1m", seed=0)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    out = []
    for i in range(rows):
        tokens, mask, turns = [randint(0, len(TOK) - 1) for _ in range(3)], [False] * 3, []
        n_turns = randint(1, 3)
        for k in range(n_turns):
            start = len(tokens)
            tokens += [randint(0, len(TOK) - 1) for _ in range(randint(1, 6))]
            end = len(tokens)
            obs = randint(1, 3) if k < n_turns - 1 else 0
            tokens += [randint(0, len(TOK) - 1) for _ in range(obs)]
            mask += [True] * (end - start) + [False] * obs
            turns.append(Turn(start, end, len(tokens)))
        with torch.no_grad():
            ids = torch.tensor([tokens])
            lp = sequence_logprobs(policy, ids, torch.ones_like(ids, dtype=torch.bool))[0]
        noisy = lp + 0.3 * torch.randn(lp.shape, generator=g)
        out.append(
            Trajectory(
                prompt_id=f"p{i}",
                tokens=tuple(tokens),
                action_mask=tuple(mask),
                rollout_logp=tuple(
                    float(v) if m else 0.0 for v, m in zip(noisy, mask, strict=True)
                ),
                versions=tuple(0 if m else -1 for m in mask),
                turns=tuple(turns),
                reward=float(randint(0, 1)),
                finish_reason="stop",
                group_id=f"g{i // group_size}" if group_size > 1 else f"p{i}",
            )
        )
    return out


def make_trainer(name: str, ranks: RankContext, dtype: torch.dtype = torch.float32) -> Trainer:
    algo = ALGOS[name]
    policy = build_tiny_policy(TOK, size="0.1m", seed=0).to(dtype=dtype)
    critic = None
    if algo.use_critic:
        critic = ValueModel.from_policy(policy)
        if algo.freeze_critic_attention:
            freeze_attention(critic)
    return Trainer(policy, critic, algo, SETTINGS, ranks)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Full policy and critic weights (on rank 0; ``{}`` on the others)."""
    out = {f"policy.{k}": v for k, v in full_state_dict(trainer.policy).items()}
    if trainer.critic is not None:
        out |= {f"critic.{k}": v for k, v in full_state_dict(trainer.critic).items()}
    return out


def run_scenario(
    name: str,
    ranks: RankContext,
    *,
    save: Path | None = None,
    load: Path | None = None,
    export: Path | None = None,
) -> Result:
    """Two steps on two batches; with ``load``, the first is replaced by
    resuming from a checkpoint written after it; with ``save``, one is written
    after the first step; with ``export``, the Hugging Face export after the second."""
    trainer = make_trainer(name, ranks)
    rows, group = ROWS[name], ALGOS[name].group_size
    result: Result = {}
    if load is not None:
        load_sharded(load, trainer)
        assert trainer.critic_sched is not None
        adam = trainer.actor_optim.state[trainer.actor_weights.params[0]]
        result["restored"] = {
            "critic_sched_epoch": torch.tensor(float(trainer.critic_sched.last_epoch)),
            "critic_lr": torch.tensor(trainer.critic_optim.param_groups[0]["lr"]),  # type: ignore[union-attr]
            "actor_adam_step": torch.as_tensor(adam["step"]).float().clone(),
        }
    else:
        result["stats1"] = trainer.step(make_batch(1, rows, group))
        result["weights1"] = weights(trainer)
        if save is not None:
            save_sharded(save, trainer)
    result["stats2"] = trainer.step(make_batch(2, rows, group))
    result["weights2"] = weights(trainer)
    if export is not None:
        save_pretrained_gathered(trainer.policy, export / "policy", ranks)
        if trainer.critic is not None:
            save_pretrained_gathered(trainer.critic, export / "critic", ranks)
    return result


def run_bf16(ranks: RankContext) -> Result:
    """One SAO step with bf16 models (FSDP2: float32 shards, bf16 compute)."""
    trainer = make_trainer("sao", ranks, torch.bfloat16)
    stats = trainer.step(make_batch(1, ROWS["sao"], 1))
    dtypes = {str(p.dtype) for p in trainer.policy.parameters()}
    masters = {str(m.dtype) for m in trainer.actor_weights.params}
    return {
        "stats1": stats,
        "weights1": weights(trainer),
        "dtypes": {f"param:{d}": torch.ones(()) for d in dtypes}
        | {f"master:{d}": torch.ones(()) for d in masters},
    }


def rank_main(rank: int, world: int, port: int, tmp: str, names: list[str]) -> None:
    """A spawned trainer rank: every scenario, plus resuming the single-process
    checkpoints of ``tmp/one``; rank ``r`` saves its results to ``tmp/rank{r}.pt``."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    ranks = init_trainer_group("cpu")
    try:
        results = {}
        results["sao/bf16"] = run_bf16(ranks)
        for name in names:
            export = Path(tmp, "hf") if name == "sao" else None
            results[name] = run_scenario(name, ranks, save=Path(tmp, "two", name), export=export)
            if Path(tmp, "one", name).exists():
                results[f"{name}/resumed"] = run_scenario(name, ranks, load=Path(tmp, "one", name))
        torch.save(results, Path(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
