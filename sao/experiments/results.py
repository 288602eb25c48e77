"""One finished run's results (:class:`RunResult`, its ``results.csv`` row)
and the statistics across seeds that the report's tables and plots use: the
95% t-interval (:class:`Stats`), the collapse step, the recovery after each
preference switch and the mean/min/max of curves (:func:`aggregate`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from sao.experiments.recovery import recovery_steps

__all__ = [
    "T_975",
    "Paired",
    "RunResult",
    "Stats",
    "aggregate",
    "collapse_step",
    "recoveries",
    "sign_test",
    "t_critical",
]

T_975: tuple[float, ...] = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)  # fmt: skip
"""Two-sided 95% critical values t_{0.975, df} of Student's t for df = 1..30
(standard tables; scipy is not a dependency)."""


def t_critical(df: int) -> float:
    """t_{0.975, df}: the table for df <= 30; above, the Cornish-Fisher expansion
    around z = 1.95996 (Abramowitz & Stegun 26.7.5, two terms; error < 1e-3)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(T_975):
        return T_975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Stats:
    """Mean, sample standard deviation (n - 1 in the denominator) and the 95%
    t-interval of the mean, ``mean ± t_{0.975, n-1} * std / sqrt(n)``, of the
    finite values given; std and interval are NaN for fewer than two values."""

    n: int
    mean: float
    std: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        xs = [x for x in values if math.isfinite(x)]
        n = len(xs)
        if n == 0:
            return cls(0, math.nan, math.nan, math.nan, math.nan)
        mean = sum(xs) / n
        if n == 1:
            return cls(1, mean, math.nan, math.nan, math.nan)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
        half = t_critical(n - 1) * std / math.sqrt(n)
        return cls(n, mean, std, mean - half, mean + half)

    def cell(self, digits: int = 3) -> str:
        """``"0.600 ± 0.265 [-0.057, 1.257]"`` (a Markdown table cell)."""
        if self.n == 0:
            return "n/a"
        if self.n == 1:
            return f"{self.mean:.{digits}f} (one seed)"
        f = f".{digits}f"
        return f"{self.mean:{f}} ± {self.std:{f}} [{self.low:{f}}, {self.high:{f}}]"


def sign_test(diffs: Sequence[float]) -> float:
    """Two-sided exact sign-test p-value of ``diffs`` (zeros dropped): the chance,
    with a fair coin per nonzero difference, of a split at least as uneven as the
    one seen. ``min(1, 2 * P(X <= min(n+, n-)))``, X ~ Binomial(n, 1/2); 1 when
    every difference is 0. Three seeds that all agree give 2 / 8 = 0.25: three
    seeds can never reach p < 0.05 on their own."""
    pos = sum(d > 0 for d in diffs)
    neg = sum(d < 0 for d in diffs)
    n = pos + neg
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(pos, neg) + 1)) / 2**n
    return min(1.0, 2 * tail)


@dataclass(frozen=True)
class Paired:
    """Arm A minus arm B on the seeds both finished: the per-seed differences,
    their :class:`Stats` (mean and 95% t-interval) and the sign test's p."""

    seeds: tuple[int, ...]
    diffs: tuple[float, ...]
    stats: Stats
    p_sign: float

    @classmethod
    def of(cls, a: dict[int, float], b: dict[int, float]) -> Paired:
        """``a`` and ``b`` map seed -> value; only common seeds with finite values pair."""
        seeds = tuple(
            s for s in sorted(set(a) & set(b)) if math.isfinite(a[s]) and math.isfinite(b[s])
        )
        diffs = tuple(a[s] - b[s] for s in seeds)
        return cls(seeds, diffs, Stats.of(diffs), sign_test(diffs))

    def verdict(self) -> str:
        """``A > B`` / ``A < B`` when the t-interval excludes 0, else ``not separated
        at N seeds`` (N < 2: ``one seed``)."""
        st = self.stats
        if st.n < 2:
            return "one seed" if st.n == 1 else "no common seeds"
        if st.low > 0:
            return "A > B"
        if st.high < 0:
            return "A < B"
        return f"not separated at {st.n} seeds"


def collapse_step(evals: Sequence[tuple[int, float]], until: int | None = None) -> int | None:
    """The first eval step after which held-out success stays below half its
    initial value (at that eval and every later one); None if it never does, or
    if the initial value is 0. ``evals``: ``(step, success)`` in step order.
    ``until``: only evals before this step count (an experiment with preference
    switches passes the first: after it, success is judged by another
    preference, and a drop there is a failure to follow, not a collapse)."""
    if until is not None:
        evals = [e for e in evals if e[0] < until]
    if not evals or evals[0][1] <= 0:
        return None
    threshold = evals[0][1] / 2
    found: int | None = None  # the start of the current stretch below the threshold
    for step, value in evals[1:]:
        below = value < threshold
        found = (found if found is not None else step) if below else None
    return found


GAIN = 0.20
"""The held-out gain whose wall time the report gives per arm (+20 points)."""


def minutes_to_gain(run: RunResult, gain: float = GAIN) -> float | None:
    """Wall minutes from the run's start to its first held-out evaluation at least
    ``gain`` above its initial one; None where none was, or the run logged no
    evaluation times (runs carried as numbers only)."""
    evals = run.curves.get("eval/success", [])
    wall = dict(run.curves.get("eval/wall_s", []))
    if not evals or not wall:
        return None
    target = evals[0][1] + gain - 1e-9
    return next((wall[s] / 60 for s, v in evals[1:] if v >= target and s in wall), None)


@dataclass(frozen=True)
class RunResult:
    """One finished run: its headline numbers and its curves against actor step
    (``step - algo.critic_pretrain_steps``: the critic-only warm-up is negative)."""

    arm: str
    seed: int
    actor_steps: int
    batch_size: int
    warmup_steps: int
    initial_success: float
    final_success: float
    best_success: float
    final_reward: float
    collapse_step: int | None
    wall_s: float
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    code: tuple[str, ...] = ()
    """The code versions its attempts ran, in order, each once (older runs: none)."""

    @property
    def trajectories(self) -> int:
        """Trajectories trained on, the critic-only warm-up's included."""
        return (self.actor_steps + self.warmup_steps) * self.batch_size

    def row(self, marks: Sequence[int] = ()) -> list[str]:
        """The run's ``results.csv`` row (``recovery_steps``: per switch in ``marks``,
        ``;``-separated, empty where it did not recover)."""
        steps = recoveries(self, marks)
        return [
            self.arm,
            str(self.seed),
            str(self.actor_steps),
            str(self.batch_size),
            str(self.trajectories),
            _num(self.initial_success),
            _num(self.final_success),
            _num(self.best_success),
            _num(self.final_reward),
            "" if self.collapse_step is None else str(self.collapse_step),
            f"{self.wall_s:.1f}",
            ";".join("" if x is None else str(x) for x in steps),
        ]


def _num(x: float) -> str:
    return f"{x:.4f}" if math.isfinite(x) else ""


def recoveries(run: RunResult, marks: Sequence[int]) -> list[int | None]:
    """Steps to recover after each of ``marks`` (None: not before the next one)."""
    if not marks:
        return []
    evals = run.curves.get("eval/success", [])
    ends: list[int | None] = [*marks[1:], None]
    return [recovery_steps(evals, m, until=end) for m, end in zip(marks, ends, strict=True)]


def aggregate(
    series: Sequence[list[tuple[int, float]]],
) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, mean, min and max across runs at each step any run has."""
    by_step: dict[int, list[float]] = {}
    for s in series:
        for step, v in s:
            by_step.setdefault(step, []).append(v)
    steps = sorted(by_step)
    return (
        steps,
        [sum(by_step[s]) / len(by_step[s]) for s in steps],
        [min(by_step[s]) for s in steps],
        [max(by_step[s]) for s in steps],
    )


def gain_cell(runs: Sequence[RunResult]) -> str:
    """The report's cell: mean wall minutes to +GAIN held-out over the runs that got there, and how
    many did ("n/a" where no run logged its evaluations' times)."""
    timed = [r for r in runs if r.curves.get("eval/wall_s")]
    if not timed:
        return "n/a"
    got = [m for r in timed if (m := minutes_to_gain(r)) is not None]
    mean = f"{sum(got) / len(got):.1f} " if got else ""
    return f"{mean}({len(got)}/{len(timed)})"
