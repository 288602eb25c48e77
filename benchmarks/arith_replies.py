"""What the held-out replies of an arithmetic run say, per evaluation: success
by kind of question (sums, differences >= 0, differences < 0), the share of
replies with the ``answer`` marker, and how concentrated the answers are (the
most frequent answer's share: a policy drifting to favourite numbers shows
here before it shows in a reward curve). Reads ``eval_samples.jsonl``.

    python benchmarks/arith_replies.py RUN_DIR [RUN_DIR ...]
    python benchmarks/arith_replies.py RUN_DIR --changed 0 30   # questions won and lost
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

QUESTION = re.compile(
    r"Calculate (-?\d+) ([+-]) (-?\d+)\.\s*Finish with 'answer X'\.\s*assistant\s*$"
)
ANSWER = re.compile(r"answer\s*(-?\d+)")


def kind(prompt: str) -> tuple[str, str]:
    """The held-out question (its last one) and its kind."""
    m = QUESTION.search(prompt)
    if m is None:
        return "?", "other"
    a, op, b = int(m[1]), m[2], int(m[3])
    q = f"{a} {op} {b}"
    if op == "+":
        return q, "sum"
    return q, "difference >= 0" if a - b >= 0 else "difference < 0"


def rows(run: Path) -> dict[int, list[dict[str, object]]]:
    by_step: dict[int, list[dict[str, object]]] = {}
    for line in (run / "eval_samples.jsonl").read_text().splitlines():
        r = json.loads(line)
        by_step.setdefault(int(r["step"]), []).append(r)
    return by_step


def table(run: Path) -> None:
    print(f"\n{run}")
    kinds = ("sum", "difference >= 0", "difference < 0")
    head = " | ".join(f"{k} right" for k in kinds)
    print(f"| step | success | {head} | marker | distinct answers | top answer share |")
    print("|---|---|" + "---|" * len(kinds) + "---|---|---|")
    for step, rs in sorted(rows(run).items()):
        right: Counter[str] = Counter()
        total: Counter[str] = Counter()
        answers: Counter[str] = Counter()
        for r in rs:
            _, k = kind(str(r["prompt"]))
            total[k] += 1
            right[k] += float(r["reward"]) > 0.5  # type: ignore[arg-type]
            m = ANSWER.search(str(r["reply"]))
            answers[m[1] if m else "<none>"] += 1
        n = len(rs)
        cells = " | ".join(f"{right[k]}/{total[k]}" for k in kinds)
        marked = n - answers["<none>"]
        top = answers.most_common(1)[0]
        print(
            f"| {step} | {sum(right.values()) / n:.2f} | {cells} | {marked}/{n} "
            f"| {len(answers)} | {top[1] / n:.2f} (`{top[0]}`) |"
        )


def changed(run: Path, first: int, last: int) -> None:
    by_step = rows(run)
    a = {int(r["index"]): r for r in by_step[first]}  # type: ignore[call-overload]
    b = {int(r["index"]): r for r in by_step[last]}  # type: ignore[call-overload]
    won = [i for i in a if i in b and float(a[i]["reward"]) < 0.5 <= float(b[i]["reward"])]  # type: ignore[arg-type]
    lost = [i for i in a if i in b and float(b[i]["reward"]) < 0.5 <= float(a[i]["reward"])]  # type: ignore[arg-type]
    print(f"\n{run}: step {first} -> {last}: {len(won)} questions won, {len(lost)} lost")
    print(f"| question | step {first} | step {last} |")
    print("|---|---|---|")
    for i in won[:6] + lost[:3]:
        q, _ = kind(str(a[i]["prompt"]))
        tag = "" if i in won else " (lost)"
        print(f"| {q}{tag} | `{a[i]['reply']}` | `{b[i]['reply']}` |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--changed", nargs=2, type=int, metavar=("FIRST", "LAST"))
    args = p.parse_args()
    for run in args.runs:
        table(run)
        if args.changed:
            changed(run, *args.changed)


if __name__ == "__main__":
    main()
