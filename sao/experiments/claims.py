"""Pre-stated claims and their verdicts, computed from the runs, never typed.

An experiment states its claims before it runs (:attr:`Experiment.claims`),
one string each::

    "sao > grpo"                           final held-out success, paired by seed
    "best: sao > grpo"                     best held-out success instead
    "collapse: grpo > sao"                 grpo collapses more often than sao
    "sao_k4 - grpo_k4 > sao_k0 - grpo_k0"  a contrast: the gap grows with staleness

Each side is arms joined by ``+`` and ``-``; the claim is that the contrast
``left - right`` is above 0. Per seed that every arm of the claim finished,
the contrast is a number (for ``collapse`` each arm counts 1 if that run
collapsed, else 0). The verdict:

* ``final`` / ``best``: **reproduced** when the 95% t-interval of the mean
  contrast lies above 0, **reversed** when below, else **not separated at N
  seeds**.
* ``collapse``: the t-interval of 0/1 differences is degenerate for small
  counts (every seed alike gives a zero-width interval), so the verdict is the
  exact sign test over the seeds where the contrast is not 0 (McNemar's exact
  test for two arms): reproduced when p < 0.05 and the nonzero contrasts are
  mostly positive, reversed when mostly negative, else not separated. The
  counts per arm are reported with exact (Clopper-Pearson) 95% intervals.

A claim is reproduced only as a whole; the report lists every claim's
verdict, and its summary counts them (:func:`summary`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path

from sao.experiments.earlier import runs_of_csv
from sao.experiments.results import Paired, RunResult, Stats, sign_test

MEASURES = ("final", "best", "collapse")
ALPHA = 0.05
_TERM = re.compile(r"\s*([+-]?)\s*([A-Za-z0-9][A-Za-z0-9_.-]*)\s*")


class ClaimError(ValueError):
    """A claim that does not parse, or names an arm the experiment lacks."""


def _side(text: str, sign: int, claim: str) -> dict[str, int]:
    out: dict[str, int] = {}
    text = text.strip()
    pos = 0
    first = True
    while pos < len(text):
        m = _TERM.match(text, pos)
        if m is None or m.end() == pos or (not first and not m.group(1)):
            raise ClaimError(f"claim {claim!r}: cannot read {text[pos:]!r} (arms joined by + or -)")
        s = -1 if m.group(1) == "-" else 1
        out[m.group(2)] = out.get(m.group(2), 0) + sign * s
        pos, first = m.end(), False
    if not out:
        raise ClaimError(f"claim {claim!r}: a side names no arm")
    return out


@dataclass(frozen=True)
class Claim:
    """``sum(weight[arm] * value(arm)) > 0`` on ``measure``, paired by seed."""

    text: str
    measure: str
    weights: tuple[tuple[str, int], ...]

    @classmethod
    def parse(cls, text: str, arms: Sequence[str] | None = None) -> Claim:
        """``[measure:] LEFT > RIGHT``; ``arms``: the experiment's, to check names."""
        measure, body = "final", text
        head, colon, rest = text.partition(":")
        if colon:
            measure, body = head.strip(), rest
            if measure not in MEASURES:
                raise ClaimError(
                    f"claim {text!r}: unknown measure {measure!r} ({', '.join(MEASURES)})"
                )
        if body.count(">") != 1 or "<" in body:
            raise ClaimError(f"claim {text!r}: needs exactly one '>' (LEFT > RIGHT)")
        left, right = body.split(">")
        weights = _side(left, 1, text)
        for arm, w in _side(right, -1, text).items():
            weights[arm] = weights.get(arm, 0) + w
        weights = {a: w for a, w in weights.items() if w}
        if not weights:
            raise ClaimError(f"claim {text!r}: both sides cancel")
        for arm in weights:
            if arms is not None and arm not in arms:
                raise ClaimError(
                    f"claim {text!r} names arm {arm!r}, which the experiment lacks "
                    f"(arms: {', '.join(arms)})"
                )
        return cls(text.strip(), measure, tuple(weights.items()))

    @property
    def body(self) -> str:
        """The comparison without its ``measure:`` prefix."""
        return self.text.partition(":")[2].strip() if ":" in self.text else self.text

    def contrast(self, values: Mapping[str, Mapping[int, float]]) -> dict[int, float]:
        """seed -> the contrast, for the seeds where every arm of the claim has a
        finite value (``values``: arm -> seed -> value)."""
        arms = [a for a, _ in self.weights]
        seeds = set.intersection(*(set(values.get(a, {})) for a in arms))
        out = {}
        for s in sorted(seeds):
            xs = [values[a][s] for a in arms]
            if all(math.isfinite(x) for x in xs):
                out[s] = sum(w * x for (_, w), x in zip(self.weights, xs, strict=True))
        return out


@dataclass(frozen=True)
class Verdict:
    """A claim judged on its paired contrasts."""

    claim: Claim
    paired: Paired
    word: str
    """``reproduced``, ``reversed`` or ``not separated at N seeds`` (``one seed``, ``no seeds``)."""


def judge(claim: Claim, values: Mapping[str, Mapping[int, float]]) -> Verdict:
    """The verdict of ``claim`` on ``values`` (arm -> seed -> final, best, or 1/0
    collapsed, as the claim's measure says)."""
    per_seed = claim.contrast(values)
    diffs = tuple(per_seed.values())
    paired = Paired(tuple(per_seed), diffs, Stats.of(diffs), sign_test(diffs))
    n = len(diffs)
    if n < 2:
        return Verdict(claim, paired, "one seed" if n == 1 else "no seeds")
    if claim.measure == "collapse":
        up = sum(d > 0 for d in diffs) > sum(d < 0 for d in diffs)
        significant = paired.p_sign < ALPHA
        word = ("reproduced" if up else "reversed") if significant else ""
    else:
        st = paired.stats
        word = "reproduced" if st.low > 0 else "reversed" if st.high < 0 else ""
    return Verdict(claim, paired, word or f"not separated at {n} seeds")


def summary(verdicts: Sequence[Verdict]) -> str:
    """``"2 of 5 claims reproduced, 3 not separated, 0 reversed"``, and how many
    could not be judged yet (fewer than two seeds with every arm of the claim)."""
    rep = sum(v.word == "reproduced" for v in verdicts)
    rev = sum(v.word == "reversed" for v in verdicts)
    unjudged = sum(len(v.paired.seeds) < 2 for v in verdicts)
    rest = len(verdicts) - rep - rev - unjudged
    text = f"{rep} of {len(verdicts)} claims reproduced, {rest} not separated, {rev} reversed"
    return text + (f", {unjudged} not yet judged (under 2 seeds)" if unjudged else "")


def _binom_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def _solve(f: Callable[[float], float], target: float) -> float:
    """The p in [0, 1] where the increasing ``f(p)`` reaches ``target`` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact two-sided binomial interval for ``k`` successes in ``n`` trials: the
    lower end solves P(X >= k | p) = a/2 (0 when k = 0), the upper end
    P(X <= k | p) = a/2 (1 when k = n), ``a = 1 - level``."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"need 0 <= k <= n and n >= 1, got k={k}, n={n}")
    a = (1 - level) / 2
    low = 0.0 if k == 0 else _solve(lambda p: 1 - _binom_cdf(k - 1, n, p), a)
    high = 1.0 if k == n else _solve(lambda p: -_binom_cdf(k, n, p), -a)
    return low, high


@dataclass(frozen=True)
class Outcome:
    """What the claims read of one run (a ``RunResult``, or a ``results.csv`` row)."""

    arm: str
    seed: int
    final: float
    best: float
    collapsed: bool

    @classmethod
    def of(cls, run: RunResult) -> Outcome:
        return cls(run.arm, run.seed, run.final_success, run.best_success,
                   run.collapse_step is not None)  # fmt: skip


def outcomes_csv(text: str) -> list[Outcome]:
    """The outcomes of a report's ``results.csv``."""
    return [Outcome.of(r) for r in runs_of_csv(text)]


def values(outcomes: Sequence[Outcome], measure: str) -> dict[str, dict[int, float]]:
    """arm -> seed -> the measure (``collapse``: 1.0 collapsed, 0.0 not)."""
    out: dict[str, dict[int, float]] = {}
    for o in outcomes:
        v = float(o.collapsed) if measure == "collapse" else getattr(o, measure)
        out.setdefault(o.arm, {})[o.seed] = v
    return out


def judge_all(claims: Sequence[str], outcomes: Sequence[Outcome]) -> list[Verdict]:
    """Every claim's verdict on ``outcomes``."""
    parsed = [Claim.parse(c) for c in claims]
    return [judge(c, values(outcomes, c.measure)) for c in parsed]


def claims_md(claims: Sequence[str], outcomes: Sequence[Outcome]) -> list[str]:
    """The claims table, its summary, and each arm's collapse count with its
    exact interval (Markdown lines; [] without claims)."""
    if not claims:
        return []
    verdicts = judge_all(claims, outcomes)
    out = [
        "Pre-stated claims, each judged on the seeds every arm it names finished, paired "
        "by seed. Contrast: the claim's left side minus its right side (held-out success, "
        "or 1/0 collapsed), mean [95% t-interval]; p: the two-sided exact sign test. "
        "A claim on success is reproduced only where the interval lies above 0 (reversed: "
        "below); a collapse claim where the sign test gives p < 0.05 (docs/experiments.md). "
        "For a claim on final success, the same contrast of best success is shown beside "
        "it; it does not enter the verdict.",
        "",
        "| claim | measure | seeds | contrast | p (sign) | verdict | best: contrast | p (sign) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    best = values(outcomes, "best")
    for v in verdicts:
        side = ["", ""]
        if v.claim.measure == "final":
            b = judge(Claim(v.claim.text, "best", v.claim.weights), best).paired
            side = [b.stats.cell(), f"{b.p_sign:.3g}"]
        out.append(
            f"| `{v.claim.body}` | {v.claim.measure} | {len(v.paired.seeds)} "
            f"| {v.paired.stats.cell()} | {v.paired.p_sign:.3g} | **{v.word}** | "
            + " | ".join(side)
            + " |"
        )
    out += ["", f"Verdict: {summary(verdicts)}.", ""]
    out += ["| arm | collapsed | 95% exact interval |", "|---|---|---|"]
    for arm in dict.fromkeys(o.arm for o in outcomes):
        n = sum(o.arm == arm for o in outcomes)
        k = sum(o.collapsed for o in outcomes if o.arm == arm)
        low, high = clopper_pearson(k, n)
        out.append(f"| `{arm}` | {k}/{n} | [{low:.3f}, {high:.3f}] |")
    return out


def verdicts_md(dirs: Sequence[str | PathLike[str]]) -> list[str]:
    """One table of every pre-stated claim of the experiment directories ``dirs``
    (each holding ``experiment.json`` and the report's ``results.csv``; a copy of
    those two files is enough), for a status page."""
    out = [
        "| experiment | claim | measure | seeds | contrast [95% interval] | p (sign) | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    totals = []
    for d in map(Path, dirs):
        meta = json.loads((d / "experiment.json").read_text())
        claims = meta["definition"].get("claims", [])
        outcomes = outcomes_csv((d / "results.csv").read_text())
        verdicts = judge_all(claims, outcomes)
        for v in verdicts:
            out.append(
                f"| `{meta['name']}` | `{v.claim.body}` | {v.claim.measure} "
                f"| {len(v.paired.seeds)} | {v.paired.stats.cell()} | {v.paired.p_sign:.3g} "
                f"| **{v.word}** |"
            )
        totals.append(f"`{meta['name']}`: {summary(verdicts) if verdicts else 'no claims stated'}")
    table = [*out, ""] if len(out) > 2 else []
    return [*table, *(f"- {t}" for t in totals)]
