"""Can SAO's critic learn the value of a turn on smollm2-guess, given data?

A run's critic sees 16 new episodes a batch from a moving policy; this holds
the policy fixed and gives the critic more. It samples ``--train`` episodes
(temperature 0.8, the preset's) from one policy (the initial checkpoint, or a
run's ``final/``), trains a fresh critic on them as a run does (K=2 updates a
batch of 16, frozen attention, LR 1e-4, the preset's algorithm), and after
each pass reads its value at the start of each turn of ``--held-out`` other
sampled episodes against their outcomes: AUC and explained variance by turn.

Beside it, what is there to learn: the outcome predicted from the state alone
by the best table of (turn, width of the interval the feedback allows) fitted
on the same training episodes (a value that knows the game's state and
nothing else), judged on the same held-out episodes.

    python benchmarks/critic_turns.py                       # initial policy
    python benchmarks/critic_turns.py --policy RUN_DIR/final --passes 4
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import defaultdict
from pathlib import Path

import torch

from sao.algo.stats import binary_auc, explained_variance_n
from sao.app.engines import context_window
from sao.config import load_config
from sao.envs.registry import make_task
from sao.envs.tiny.guess_number import GuessNumberEnv, GuessNumberTask
from sao.models.fetch import resolve_model_path
from sao.models.freeze import freeze_attention
from sao.models.loading import load_policy, load_tokenizer
from sao.models.value import ValueModel
from sao.rollout.agent import EpisodeLimits
from sao.rollout.chat import decode_reply
from sao.rollout.embedded.engine import TorchEngine
from sao.runtime.runner import LocalRunner, samples
from sao.train.critic_fit import turn_values
from sao.train.trainer import OptimSettings, Trainer
from sao.types import SamplingParams, Trajectory

PRESET = "smollm2-guess-sao"


async def play(
    policy: torch.nn.Module, tokenizer: object, task: GuessNumberTask, split: str, n: int
) -> list[Trajectory]:
    cfg = load_config(PRESET)
    r = cfg.rollout
    limits = EpisodeLimits(max_turns=r.max_turns, max_total_tokens=r.max_total_tokens)
    sampling = SamplingParams(temperature=r.temperature, max_new_tokens=r.max_new_tokens)
    context = context_window(policy, r.max_total_tokens)
    with TorchEngine(policy, max_batch_size=64, max_seq_len=context, tokenizer=tokenizer) as eng:
        runner = LocalRunner(task, eng, tokenizer, limits)  # type: ignore[arg-type]
        played = await asyncio.gather(
            *(
                runner.run(
                    split, i, seed=i, prompt_id=f"{split}/{i}", group_id="", sampling=sampling
                )
                for i in range(n)
            )
        )
    return [samples(p)[-1] for p in played]


def states(
    task: GuessNumberTask, tokenizer: object, split: str, trajs: list[Trajectory]
) -> list[list[tuple[int, int]]]:
    """(turn index, width of the interval the feedback allows) at the start of each
    turn of each episode, replayed from its decoded actions through a fresh env."""
    out = []
    for i, t in enumerate(trajs):
        env: GuessNumberEnv = task.make_env(split, i)  # type: ignore[assignment]
        lo, hi, seen = 1, task.n, []
        for k, turn in enumerate(t.turns):
            seen.append((k, hi - lo + 1))
            res = env.act(decode_reply(tokenizer, list(t.tokens[turn.start : turn.end])))
            if res.observation == "higher":
                lo = max(lo, env.guesses[-1] + 1)
            elif res.observation == "lower":
                hi = min(hi, env.guesses[-1] - 1)
        out.append(seen)
    return out


def fit_by_turn(values: list[list[float]], rewards: list[float]) -> dict[int, tuple[float, float]]:
    out = {}
    for k in range(max(len(v) for v in values)):
        pairs = [(v[k], r) for v, r in zip(values, rewards, strict=True) if len(v) > k]
        if len(pairs) < 4 or len({r for _, r in pairs}) < 2:
            continue
        v = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
        r = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
        out[k + 1] = (float(binary_auc(v, r > 0.5)), float(explained_variance_n(v, r)))
    return out


def row(name: str, fit: dict[int, tuple[float, float]], turns: int) -> str:
    cells = [f"{fit[k][0]:.2f} / {fit[k][1]:.2f}" if k in fit else "-" for k in range(1, turns + 1)]
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="smollm2-135m")
    ap.add_argument("--train", type=int, default=256)
    ap.add_argument("--held-out", type=int, default=128)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    cfg = load_config(PRESET)
    path = Path(args.policy) if Path(args.policy).is_dir() else resolve_model_path(args.policy)
    tokenizer, policy = load_tokenizer(path), load_policy(path)
    task = make_task("guess_number", seed=0, **cfg.task.options)
    assert isinstance(task, GuessNumberTask)
    train = asyncio.run(play(policy, tokenizer, task, "train", args.train))
    held = asyncio.run(play(policy, tokenizer, task, "eval", args.held_out))
    del policy
    rewards = [t.reward for t in held]
    turns = max(len(t.turns) for t in held)
    wins = (
        sum(t.reward > 0.5 for t in train) / len(train),
        sum(r > 0.5 for r in rewards) / len(held),
    )
    print(
        f"{path}: {len(train)} train / {len(held)} held-out sampled episodes, success "
        f"{wins[0]:.2f} / {wins[1]:.2f}, {time.perf_counter() - t0:.0f} s"
    )

    # what there is to learn: mean outcome per (turn, interval width) on the train episodes
    table: dict[tuple[int, int], list[float]] = defaultdict(list)
    for st, t in zip(states(task, tokenizer, "train", train), train, strict=True):
        for s in st:
            table[s].append(t.reward)
    mean = sum(t.reward for t in train) / len(train)
    oracle = [
        [sum(table[s]) / len(table[s]) if table.get(s) else mean for s in st]
        for st in states(task, tokenizer, "eval", held)
    ]
    print("\n| critic | " + " | ".join(f"AUC / EV turn {k}" for k in range(1, turns + 1)) + " |")
    print("|---|" + "---|" * turns)
    print(row("(turn, interval width) table", fit_by_turn(oracle, rewards), turns))

    critic = ValueModel.from_policy(path, seed=0)
    freeze_attention(critic)
    settings = OptimSettings(critic_lr=cfg.train.critic_lr, critic_lr_warmup_steps=10)
    trainer = Trainer(None, critic, cfg.algo.resolve(), settings)
    print(
        row("critic, untrained", fit_by_turn(turn_values(trainer, held), rewards), turns),
        flush=True,
    )
    for p in range(args.passes):
        for i in range(0, len(train), 16):
            trainer.step(train[i : i + 16], train_actor=False)
        fit = fit_by_turn(turn_values(trainer, held), rewards)
        print(
            row(f"critic, {p + 1} pass(es) ({(p + 1) * len(train)} episodes)", fit, turns),
            flush=True,
        )
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
