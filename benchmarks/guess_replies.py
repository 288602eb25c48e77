"""What the held-out games of a guess-number run say, per evaluation: success,
model turns, the share of later guesses inside the interval earlier feedback
allows, and the reward hacks to rule out before believing a curve: an action
holding several guesses, a guess outside the range, a repeated guess, a
malformed action, an action that parrots the feedback (``higher``/``lower``).
Success by turn count shows where games are won. Reads ``eval_samples.jsonl``;
with ``--critic``, also ``metrics.jsonl``: the critic's held-out AUC and
explained variance at the start of each turn, per evaluation, and the share of
tokens the DIS band masked, per step, beside the staleness and the KL to the
rollout policy.

    python benchmarks/guess_replies.py RUN_DIR [RUN_DIR ...] [--critic]
    python benchmarks/guess_replies.py RUN_DIR --show 0 30 --games 3   # transcripts
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from arith_replies import rows  # eval_samples.jsonl by evaluation step

GUESS = re.compile(r"^guess\s*:?\s*(-?\d{1,12})\s*\.?$", re.IGNORECASE)
RANGE = re.compile(r"guess a number in 1-(\d+)")


@dataclass
class Game:
    """One held-out episode read back from its reply text."""

    actions: list[str]
    feedback: list[str]
    reward: float
    n: int
    guesses: list[int] = field(default_factory=list)
    inside: list[bool] = field(default_factory=list)
    several: int = 0
    malformed: int = 0
    out_of_range: int = 0
    repeated: int = 0
    parroted: int = 0

    def read(self) -> Game:
        lo, hi = 1, self.n
        for k, action in enumerate(self.actions):
            lines = [ln.strip() for ln in action.strip().splitlines() if ln.strip()]
            self.several += sum(bool(GUESS.match(ln)) for ln in lines) > 1
            self.parroted += any(w in action.lower() for w in ("higher", "lower"))
            m = GUESS.match(lines[-1]) if lines else None
            if m is None:
                self.malformed += 1
                continue
            g = int(m[1])
            if not 1 <= g <= self.n:
                self.out_of_range += 1
                continue
            self.repeated += g in self.guesses
            if self.guesses:
                self.inside.append(lo <= g <= hi)
            self.guesses.append(g)
            answer = self.feedback[k] if k < len(self.feedback) else ""
            if answer == "higher":
                lo = max(lo, g + 1)
            elif answer == "lower":
                hi = min(hi, g - 1)
        return self


def game(row: dict[str, object]) -> Game:
    """The actions (the reply's assistant turns) and the feedback between them."""
    prompt, reply = str(row["prompt"]), str(row["reply"])
    ranges = RANGE.findall(prompt)
    parts = re.split(r"\n(user|assistant)\n", reply)
    actions, feedback = [parts[0]], []
    for role, text in zip(parts[1::2], parts[2::2], strict=True):
        (feedback if role == "user" else actions).append(text.strip())
    n = int(ranges[-1]) if ranges else 16
    return Game(actions, feedback, float(row["reward"]), n).read()  # type: ignore[arg-type]


def table(run: Path) -> None:
    print(f"\n{run}")
    print(
        "| step | success | turns | in interval | several guesses | malformed | out of range "
        "| repeated | parroted | won at turn 1/2/3/4/5 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for step, rs in sorted(rows(run).items()):
        games = [game(r) for r in rs]
        n = len(games)
        inside = [x for g in games for x in g.inside]
        actions = sum(len(g.actions) for g in games)
        won = Counter(len(g.actions) for g in games if g.reward > 0.5)
        counts = {
            k: sum(getattr(g, k) for g in games)
            for k in ("several", "malformed", "out_of_range", "repeated", "parroted")
        }
        cells = " | ".join(f"{v}/{actions}" for v in counts.values())
        print(
            f"| {step} | {sum(g.reward > 0.5 for g in games) / n:.2f} "
            f"| {actions / n:.2f} | {sum(inside) / max(len(inside), 1):.2f} | {cells} "
            f"| {'/'.join(str(won[k]) for k in range(1, 6))} |"
        )


def critic(run: Path) -> None:
    """The critic's calibration by turn, per evaluation; DIS masking per step."""
    history = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in history if "eval/critic_auc_turn1" in r or "eval/critic_ev_turn1" in r]
    turns = range(1, 6)
    print("\n| step | " + " | ".join(f"AUC / EV turn {k}" for k in turns) + " |")
    print("|---|" + "---|" * len(turns))
    for r in evals:
        cells = [
            f"{r.get(f'eval/critic_auc_turn{k}', float('nan')):.2f} / "
            f"{r.get(f'eval/critic_ev_turn{k}', float('nan')):.2f}"
            for k in turns
        ]
        print(f"| {r['step']} | " + " | ".join(cells) + " |")
    steps = [r for r in history if "dis/masked_frac" in r]
    nan = float("nan")
    if steps:
        print(
            "\n| step | DIS masked | low / high | their share of the advantage mass "
            "| masked with A < 0 | staleness mean | k3 KL | ev gate |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in steps:
            print(
                f"| {r['step']} | {r['dis/masked_frac']:.3f} | {r['dis/masked_low_frac']:.3f} / "
                f"{r['dis/masked_high_frac']:.3f} | {r.get('dis/masked_adv_share', nan):.3f} "
                f"| {r.get('dis/masked_neg_adv_frac', nan):.3f} "
                f"| {r.get('staleness/mean', nan):.2f} "
                f"| {r.get('dis/kl_k3', nan):.3f} | {r.get('critic/ev_gate', '')} |"
            )


def show(run: Path, steps: list[int], count: int) -> None:
    by_step = rows(run)
    for step in steps:
        print(f"\n{run} step {step}:")
        for r in by_step.get(step, [])[:count]:
            g = game(r)
            moves = [
                f"{a.strip()!r}" + (f" -> {f}" if i < len(g.feedback) else "")
                for i, (a, f) in enumerate(zip(g.actions, [*g.feedback, ""], strict=False))
            ]
            print(f"  #{r['index']} reward {g.reward:.0f}: " + "; ".join(moves))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--show", type=int, nargs="*", help="print the games of these eval steps")
    ap.add_argument("--games", type=int, default=4)
    ap.add_argument("--critic", action="store_true", help="calibration by turn, DIS masking")
    args = ap.parse_args()
    for run in args.runs:
        table(run)
        if args.critic:
            critic(run)
        if args.show:
            show(run, args.show, args.games)


if __name__ == "__main__":
    main()
