"""The parts of an experiment report about preference switches (an
experiment's ``marks``, e.g. ``online``): steps each arm needs to recover
after each switch (:func:`~sao.experiments.recovery.recovery_steps`), its mean
training reward in each phase, and held-out success judged by every style
against actor step, one panel per style, the phases shaded by the style
preferred."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from sao.experiments.recovery import RECOVERED_SHARE
from sao.experiments.results import RunResult, Stats, aggregate, recoveries

if TYPE_CHECKING:
    from sao.experiments.grid import Experiment

__all__ = [
    "STYLE_PLOT",
    "STYLE_PREFIX",
    "phase_rewards",
    "recoveries",
    "recovery_md",
    "write_style_plot",
]

STYLE_PREFIX = "eval/style_"
"""Held-out success as judged by one style (``style_shift`` reports them)."""
STYLE_PLOT = "eval_per_style.png"


def phase_rewards(run: RunResult, marks: Sequence[int]) -> list[float | None]:
    """The mean sampled training reward over each phase: actor steps ``0..m1``,
    then ``m1+1..m2``, ..., after the last mark (None: no step in it)."""
    rewards = run.curves.get("train/reward", [])
    out: list[float | None] = []
    for lo, hi in zip([-1, *marks], [*marks, None], strict=True):
        got = [r for step, r in rewards if lo < step and (hi is None or step <= hi)]
        out.append(sum(got) / len(got) if got else None)
    return out


def recovery_md(exp: Experiment, runs: Sequence[RunResult]) -> list[str]:
    """Markdown lines: per arm and switch, seeds recovered and the steps they took."""
    if not exp.marks or not runs:
        return []
    head = " | ".join(f"after step {m}" for m in exp.marks)
    out = [
        f"Recovery after each switch: actor steps until held-out success (judged by the new "
        f"preference) is back to {RECOVERED_SHARE:.0%} of the best it reached before the "
        "switch (under any earlier preference), before the next switch; recovered seeds / "
        "seeds, then mean ± std "
        "[95% t-interval] over the recovered ones.",
        "",
        f"| arm | {head} |",
        "|---|" + "---|" * len(exp.marks),
    ]
    for arm in exp.arms:
        rs = [r for r in runs if r.arm == arm]
        if not rs:
            continue
        per_mark = list(zip(*(recoveries(r, exp.marks) for r in rs), strict=True))
        cells = []
        for steps in per_mark:
            got = [float(s) for s in steps if s is not None]
            cells.append(f"{len(got)}/{len(steps)}" + (f": {Stats.of(got).cell(1)}" if got else ""))
        out.append(f"| `{arm}` | {' | '.join(cells)} |")
    spans = [f"{a + 1}-{b}" for a, b in itertools.pairwise([-1, *exp.marks])]
    spans[0] = f"0-{exp.marks[0]}"
    spans.append(f"after {exp.marks[-1]}")
    out += [
        "",
        "Training reward in each phase: the mean sampled reward over the phase's actor steps, "
        "mean ± std [95% t-interval] over seeds.",
        "",
        "| arm | " + " | ".join(f"steps {s}" for s in spans) + " |",
        "|---|" + "---|" * len(spans),
    ]
    for arm in exp.arms:
        rs = [r for r in runs if r.arm == arm]
        if not rs:
            continue
        per_phase = list(zip(*(phase_rewards(r, exp.marks) for r in rs), strict=True))
        cells = [Stats.of([v for v in vs if v is not None]).cell() for vs in per_phase]
        out.append(f"| `{arm}` | {' | '.join(cells)} |")
    return [*out, ""]


def write_style_plot(
    runs: Sequence[RunResult], exp: Experiment, out_dir: Path, schedule: Sequence[str] = ()
) -> Path | None:
    """One panel per style that runs report (``eval/style_NAME``): mean over
    seeds per arm with a min-max band, the switches dashed; ``schedule`` names
    the style preferred in each phase (shaded in its panel)."""
    styles = sorted(
        {k[len(STYLE_PREFIX) :] for r in runs for k in r.curves if k.startswith(STYLE_PREFIX)}
    )
    if not styles:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(styles), figsize=(3.2 * len(styles), 3.4), dpi=110, sharey=True)
    axes = [axes] if len(styles) == 1 else list(axes)
    bounds = [
        0,
        *exp.marks,
        max(s for r in runs for s, _ in r.curves.get("eval/success", [(0, 0)])),
    ]
    for ax, style in zip(axes, styles, strict=True):
        for i, arm in enumerate(exp.arms):
            series = [
                r.curves[STYLE_PREFIX + style]
                for r in runs
                if r.arm == arm and r.curves.get(STYLE_PREFIX + style)
            ]
            if not series:
                continue
            steps, mean, lo, hi = aggregate(series)
            ax.plot(steps, mean, color=f"C{i % 10}", label=arm)
            if len(series) > 1:
                ax.fill_between(steps, lo, hi, color=f"C{i % 10}", alpha=0.2, linewidth=0)
        for k, (a, b) in enumerate(itertools.pairwise(bounds)):
            if k < len(schedule) and schedule[k] == style:
                ax.axvspan(a, b, color="gold", alpha=0.15, linewidth=0)
        for m in exp.marks:
            ax.axvline(m, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"judged as {style}", fontsize=9)
        ax.set_xlabel("actor step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out success")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{exp.name}: held-out success per style (shaded: preferred)", fontsize=9)
    fig.tight_layout()
    path = out_dir / STYLE_PLOT
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return path
