"""The report of an experiment directory, rebuilt from its run directories and
the runs it carries from elsewhere (:mod:`sao.experiments.earlier`) only:
``results.csv`` (one row per run), ``runs.jsonl`` (each run's numbers and
curves, what another copy carries), ``results.md`` (per arm: mean ± std
and a 95% t-interval over seeds) and plots (held-out success, training reward
and, when the runs have a critic, its explained variance against actor step,
one line per arm with a min-max band across seeds).

Layout read here (written by :mod:`sao.experiments.grid`)::

    DIR/experiment.json              name and definition (claim, arms, overrides)
    DIR/runs/ARM/seed-S/             a ``sao train`` run directory each
        config.yaml metrics.jsonl summary.json experiment_attempts.jsonl
    DIR/earlier.jsonl                runs carried from another copy (``--earlier``)

Only finished runs (those with ``summary.json``) are reported; others are
counted as incomplete. Everything written is a function of those files, so
``sao experiment --report DIR`` reproduces the report byte for byte.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

import yaml

from sao.config import validate
from sao.experiments.claims import Outcome, claims_md
from sao.experiments.earlier import RUNS_FILE, carried_md, earlier_runs, write_runs
from sao.experiments.grid import Experiment
from sao.experiments.results import (
    GAIN,
    Paired,
    RunResult,
    Stats,
    aggregate,
    collapse_step,
    gain_cell,
    t_critical,
)
from sao.experiments.switches import STYLE_PREFIX, recovery_md, write_style_plot
from sao.rundir.metrics import PLOTS, summarize

__all__ = [
    "CSV_COLUMNS",
    "REWARD_WINDOW",
    "RunResult",
    "Stats",
    "code_md",
    "collapse_step",
    "read_history",
    "read_run",
    "results_csv",
    "results_md",
    "scan_runs",
    "t_critical",
    "trailing_mean",
    "write_plots",
    "write_report",
]

REWARD_WINDOW = 10
"""Training reward is plotted and reported as a trailing mean over this many steps
(the same window as ``summary.json``'s ``train/reward_last10``)."""

CSV_COLUMNS = (
    "arm",
    "seed",
    "actor_steps",
    "trajectories_per_step",
    "trajectories",
    "initial_success",
    "final_success",
    "best_success",
    "final_reward",
    "collapse_step",
    "wall_s",
    "recovery_steps",
)


def trailing_mean(points: Sequence[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    """Each point's value replaced by the mean of it and up to ``window - 1`` before it."""
    values = [v for _, v in points]
    return [
        (step, sum(values[max(0, i + 1 - window) : i + 1]) / min(i + 1, window))
        for i, (step, _) in enumerate(points)
    ]


def read_history(path: Path) -> list[dict[str, float]]:
    """The rows of a ``metrics.jsonl``."""
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def read_run(run_dir: Path, arm: str, seed: int, until: int | None = None) -> RunResult:
    """A finished run directory's :class:`RunResult` (``until``: see
    :func:`collapse_step`)."""
    cfg = validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    most = cfg.algo.resolve().critic_pretrain_steps
    history = read_history(run_dir / "metrics.jsonl")
    # A warm-up ended by its plateau rule gave its remaining batches to the actor.
    ended = [int(r["step"]) for r in history if r.get("critic/pretrain_plateau") == 1]
    warmup = min(ended[0], most) if ended else most
    summary = summarize(history)

    def curve(key: str) -> list[tuple[int, float]]:
        return [
            (int(r["step"]) - warmup, float(r[key]))
            for r in history
            if key in r and math.isfinite(r[key])
        ]

    evals = curve("eval/success")
    rewards = curve("train/reward_mean")
    curves = {
        "eval/success": evals,
        "eval/wall_s": [  # (the run's wall clock at each evaluation, resumes continued)
            (int(r["step"]) - warmup, float(r["wall_s"]))
            for r in history
            if "eval/success" in r and "wall_s" in r
        ],
        "train/reward_mean": trailing_mean(rewards, REWARD_WINDOW),
        "train/reward": rewards,
    }
    if ev := curve("critic/explained_variance"):
        curves["critic/explained_variance"] = ev
    if stale := curve("staleness/mean"):
        curves["staleness/mean"] = stale
    for key in sorted({k for r in history for k in r if k.startswith(STYLE_PREFIX)}):
        curves[key] = curve(key)
    path = run_dir / "experiment_attempts.jsonl"
    attempts = [json.loads(x) for x in path.read_text().splitlines() if x] if path.is_file() else []
    wall = sum(float(a["wall_s"]) for a in attempts) if attempts else summary["wall_s"]
    code = tuple(dict.fromkeys(str(a["code"]) for a in attempts if a.get("code")))
    return RunResult(
        arm=arm,
        seed=seed,
        actor_steps=cfg.train.steps + most - warmup,
        batch_size=cfg.train.batch_size,
        warmup_steps=warmup,
        initial_success=summary["eval/success_first"],
        final_success=summary["eval/success_last"],
        best_success=summary["eval/success_best"],
        final_reward=summary["train/reward_last10"],
        collapse_step=collapse_step(evals, until),
        wall_s=wall,
        curves=curves,
        code=code,
    )


_SEED_DIR = re.compile(r"^seed-(\d+)$")


def scan_runs(
    exp_dir: Path, arms: Sequence[str], until: int | None = None
) -> tuple[list[RunResult], list[Path]]:
    """Finished runs of ``arms`` (in that order, then by seed) and unfinished run
    dirs (``until``: see :func:`collapse_step`)."""
    done: list[RunResult] = []
    unfinished: list[Path] = []
    for arm in arms:
        arm_dir = exp_dir / "runs" / arm
        seeds = sorted(
            int(m.group(1))
            for p in (arm_dir.iterdir() if arm_dir.is_dir() else [])
            if p.is_dir() and (m := _SEED_DIR.match(p.name))
        )
        for seed in seeds:
            run_dir = arm_dir / f"seed-{seed}"
            if (run_dir / "summary.json").is_file():
                done.append(read_run(run_dir, arm, seed, until))
            else:
                unfinished.append(run_dir)
    return done, unfinished


def write_report(exp_dir: Path) -> list[Path]:
    """Rebuild ``results.csv``, ``results.md`` and the plots of ``exp_dir`` from
    its run directories; returns the files written."""
    meta = json.loads((exp_dir / "experiment.json").read_text())
    exp = Experiment.from_dict(meta["definition"])
    runs, unfinished = scan_runs(exp_dir, list(exp.arms), min(exp.marks, default=None))
    here = {(r.arm, r.seed) for r in runs}
    carried = [
        r for r in earlier_runs(exp_dir) if r.arm in exp.arms and (r.arm, r.seed) not in here
    ]
    order = list(exp.arms)
    runs = sorted([*runs, *carried], key=lambda r: (order.index(r.arm), r.seed))
    write_runs(exp_dir / RUNS_FILE, runs)
    written = [exp_dir / "results.csv", exp_dir / "results.md", exp_dir / RUNS_FILE]
    written[0].write_text(results_csv(runs, exp.marks))
    plots = write_plots(runs, exp, exp_dir)
    if seeds := write_seed_plot(runs, exp, exp_dir):
        plots.append(seeds)
    if style := write_style_plot(runs, exp, exp_dir, _schedule(exp_dir, runs)):
        plots.append(style)
    overrides = list(meta.get("overrides", []))
    written[1].write_text(results_md(exp, overrides, runs, unfinished, exp_dir, plots, carried))
    return written + plots


def results_csv(runs: Sequence[RunResult], marks: Sequence[int] = ()) -> str:
    """One row per finished run (:data:`CSV_COLUMNS`)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in runs:
        w.writerow(r.row(marks))
    return buf.getvalue()


def _schedule(exp_dir: Path, runs: Sequence[RunResult]) -> list[str]:
    """The style preferred in each phase between switches, from a run's config
    (style_shift's ``schedule`` option or its default); [] for other tasks."""
    configs = (exp_dir / "runs" / r.arm / f"seed-{r.seed}" / "config.yaml" for r in runs)
    path = next((p for p in configs if p.is_file()), None)
    if path is None:
        return []
    cfg = validate(yaml.safe_load(path.read_text()))
    if cfg.task.name != "style_shift":
        return []
    from sao.envs.style.shift import DEFAULT_SCHEDULE

    return [str(style) for _, style in cfg.task.options.get("schedule", DEFAULT_SCHEDULE)]


def _comparison(runs: Sequence[RunResult]) -> str:
    """The sentence saying whether arms saw equal trajectories per step and in total."""
    per_step = sorted({r.batch_size for r in runs})
    steps = sorted({r.actor_steps for r in runs})
    total = sorted({r.trajectories for r in runs})
    if len(per_step) == 1 and len(steps) > 1 and len(total) == 1:
        arms = dict(sorted({(r.arm, r.warmup_steps) for r in runs}))
        counts = ", ".join(f"`{a}` {n}" for a, n in arms.items())
        return (
            f"Arms are compared at equal trajectories: {total[0]:,} per run, in batches of "
            f"{per_step[0]}, critic-only warm-up batches included (warm-up batches: {counts}), "
            f"so the arms with a warm-up take fewer actor steps ({steps[0]} to {steps[-1]}). "
            "Curves are drawn against actor steps."
        )
    if len(per_step) == 1 and len(steps) == 1:
        text = (
            f"Arms are compared at equal trajectories per actor step ({per_step[0]}) and equal "
            f"actor steps ({steps[0]}): {per_step[0] * steps[0]:,} trajectories of actor "
            "training per run in every arm."
        )
        warm = sorted({(r.arm, r.warmup_steps) for r in runs if r.warmup_steps})
        if warm:
            w = ", ".join(f"`{a}` {n} step{'s' * (n != 1)}" for a, n in dict(warm).items())
            text += (
                f" Critic-only warm-up steps of {per_step[0]} trajectories come on top ({w}): "
                "they sample with the frozen initial policy and train only the critic; "
                "the `trajectories` column of results.csv counts them."
            )
        return text
    return (
        "**Arms are NOT compared at equal trajectories**: trajectories per step "
        f"{per_step}, actor steps {steps} (see results.csv)."
    )


def results_md(
    exp: Experiment,
    overrides: Sequence[str],
    runs: Sequence[RunResult],
    unfinished: Sequence[Path],
    exp_dir: Path,
    plots: Sequence[Path],
    carried: Sequence[RunResult] = (),
) -> str:
    """The Markdown report: claim, comparison, per-arm table, arms' overrides, the
    runs ``carried`` from elsewhere, plots."""
    out = [f"# Experiment `{exp.name}`", "", "Claim tested:", ""]
    out += ["> " + line for line in exp.claim.splitlines()] + [""]
    if not runs:
        return "\n".join([*out, "No finished runs yet.", ""])
    out += _arms_table(exp, runs)
    if exp.claims:
        outcomes = [Outcome.of(r) for r in runs]
        out += ["", *claims_md(exp.claims, outcomes)]
    else:
        out += ["", *paired_md(exp, runs)]
    out += ["", *recovery_md(exp, runs)] if exp.marks else []
    out += _overrides_md(exp, overrides)
    out += code_md([r for r in runs if r.curves]) + carried_md(carried)  # (curves: a record)
    if unfinished:
        names = ", ".join(f"`{p.relative_to(exp_dir)}`" for p in unfinished)
        out += ["", f"Unfinished runs, not included: {names}."]
    out.append("")
    for p in plots:
        out += [f"![{p.stem}]({p.name})", ""]
    return "\n".join(out)


def _arms_table(exp: Experiment, runs: Sequence[RunResult]) -> list[str]:
    """The comparison, what a cell means, and one row per arm with finished runs."""
    seeds = sorted({r.seed for r in runs})
    out = [
        _comparison(runs),
        "",
        f"Seeds {', '.join(map(str, seeds))}. Each cell: mean ± sample std over seeds "
        "[95% t-interval of the mean]. Held-out success: greedy episodes of the eval split; "
        f"final train reward: mean over the last {REWARD_WINDOW} steps (sampled); collapsed: "
        "runs whose held-out success fell below half its initial value at an eval and "
        "stayed there (step = first such eval, in actor steps); min to +"
        f"{GAIN * 100:.0f} points: wall minutes to the first held-out evaluation that "
        "many points above the initial one, mean over the runs that reached it (how many "
        "did)"
        + (
            f"; only evals before the first switch (step {min(exp.marks)}) count."
            if exp.marks
            else "."
        ),
        "",
        "| arm | seeds | initial held-out | final held-out | best held-out "
        "| final train reward | collapsed | staleness (mean) | wall min (mean) "
        f"| min to +{GAIN * 100:.0f} points |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in exp.arms:
        rs = [r for r in runs if r.arm == arm]
        if not rs:
            continue
        collapsed = [r.collapse_step for r in rs if r.collapse_step is not None]
        col = f"{len(collapsed)}/{len(rs)}" + (
            f" (steps {', '.join(map(str, collapsed))})" if collapsed else ""
        )
        out.append(
            f"| `{arm}` | {len(rs)} | {Stats.of([r.initial_success for r in rs]).cell()} "
            f"| {Stats.of([r.final_success for r in rs]).cell()} "
            f"| {Stats.of([r.best_success for r in rs]).cell()} "
            f"| {Stats.of([r.final_reward for r in rs]).cell()} | {col} | {_staleness(rs)} "
            f"| {Stats.of([r.wall_s / 60 for r in rs]).mean:.1f} | {gain_cell(rs)} |"
        )
    return out


def _staleness(runs: Sequence[RunResult]) -> str:
    """Mean staleness over every actor step of ``runs`` ("n/a" where not logged)."""
    values = [v for r in runs for step, v in r.curves.get("staleness/mean", []) if step > 0]
    return f"{sum(values) / len(values):.2f}" if values else "n/a"


def paired_md(exp: Experiment, runs: Sequence[RunResult]) -> list[str]:
    """The first arm against each other arm, paired by seed: the difference of final
    and of best held-out success (mean [95% t-interval], the sign test's p) and
    whether the interval excludes 0."""
    arms = [a for a in exp.arms if any(r.arm == a for r in runs)]
    if len(arms) < 2:
        return []
    first = arms[0]
    out = [
        f"Paired by seed, `{first}` minus each other arm (A = `{first}`): the mean "
        "difference [95% t-interval over the common seeds], the two-sided sign test's p, "
        "and the verdict: `A > B` or `A < B` only where the interval excludes 0.",
        "",
        "| A - B | seeds | final held-out | p (sign) | verdict | best held-out | p (sign) "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def values(arm: str, key: str) -> dict[int, float]:
        return {r.seed: getattr(r, key) for r in runs if r.arm == arm}

    for other in arms[1:]:
        pairs = [Paired.of(values(first, k), values(other, k)) for k in KEYS]
        cells = [c for p in pairs for c in (p.stats.cell(), f"{p.p_sign:.3g}", p.verdict())]
        n = len(pairs[0].seeds)
        out.append(f"| `{first}` - `{other}` | {n} | " + " | ".join(cells) + " |")
    return out


KEYS = ("final_success", "best_success")
"""The run results :func:`paired_md` pairs, in its columns' order."""


def _overrides_md(exp: Experiment, overrides: Sequence[str]) -> list[str]:
    """Each arm's overrides, and what every arm starts from."""
    out = ["", "| arm | overrides |", "|---|---|"]
    for arm, sets in exp.arms.items():
        out.append(f"| `{arm}` | {' '.join(f'`{s}`' for s in sets) or '(base only)'} |")

    def code(items: Sequence[str]) -> str:
        return " ".join(f"`{s}`" for s in items)

    return [
        *out,
        "",
        f"Every arm: preset `{exp.preset}`"
        + (f", then the experiment's {code(exp.base)}" if exp.base else "")
        + (f", then this directory's `--set` {code(overrides)}" if overrides else "")
        + ". Per run: [results.csv](results.csv); run directories under `runs/ARM/seed-S`.",
    ]


def code_md(runs: Sequence[RunResult]) -> list[str]:
    """The report's line on the code the runs ran ([] when none was recorded)."""
    versions = list(dict.fromkeys(v for r in runs for v in r.code))
    if not versions:
        return []
    if len(versions) == 1 and all(r.code for r in runs):
        return ["", f"Code: every run ran `{versions[0]}`."]
    which = [
        f"`{v}` ({', '.join(f'{r.arm}/{r.seed}' for r in runs if v in r.code)})" for v in versions
    ]
    text = "**The runs did not all run the same code**: " + "; ".join(which)
    unknown = [f"{r.arm}/{r.seed}" for r in runs if not r.code]
    return ["", text + (f"; not recorded: {', '.join(unknown)}." if unknown else ".")]


_LABELS = {
    "eval/success": "held-out success (greedy)",
    "train/reward_mean": f"train reward ({REWARD_WINDOW}-step mean)",
    "critic/explained_variance": "critic explained variance",
    "staleness/mean": "staleness (versions behind, batch mean)",
}


def write_plots(runs: Sequence[RunResult], exp: Experiment, out_dir: Path) -> list[Path]:
    """One PNG per metric of :data:`_LABELS` (file names from
    :data:`sao.rundir.metrics.PLOTS`): the mean over seeds per arm, a min-max band
    across seeds, vertical lines at the experiment's ``marks`` (e.g. preference
    switches)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, label in _LABELS.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
        drawn = False
        for i, arm in enumerate(exp.arms):
            series = [r.curves[key] for r in runs if r.arm == arm and r.curves.get(key)]
            if not series:
                continue
            steps, mean, lo, hi = aggregate(series)
            color = f"C{i % 10}"
            ax.plot(steps, mean, color=color, label=f"{arm} (n={len(series)})")
            if len(series) > 1:
                ax.fill_between(steps, lo, hi, color=color, alpha=0.2, linewidth=0)
            drawn = True
        if not drawn:
            plt.close(fig)
            continue
        for j, m in enumerate(exp.marks):
            ax.axvline(
                m, color="grey", linestyle="--", linewidth=1, label="switch" if j == 0 else None
            )
        ax.set_xlabel("actor step (critic warm-up < 0)")
        ax.set_ylabel(label)
        ax.set_title(f"{exp.name}: {label}, mean and min-max over seeds", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / PLOTS[key]
        fig.savefig(path, metadata={"Software": None})
        plt.close(fig)
        written.append(path)
    return written


def write_seed_plot(runs: Sequence[RunResult], exp: Experiment, out_dir: Path) -> Path | None:
    """``eval_success_seeds.png``: held-out success of every run, one panel per arm,
    one line per seed (no run hidden in a mean)."""
    arms = [a for a in exp.arms if any(r.arm == a and r.curves.get("eval/success") for r in runs)]
    if not arms:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(arms), 4)
    rows = math.ceil(len(arms) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.2 * cols, 2.6 * rows), dpi=110, sharex=True, sharey=True,
        squeeze=False,
    )  # fmt: skip
    for ax, arm in zip(axes.flat, arms, strict=False):
        for r in (r for r in runs if r.arm == arm and r.curves.get("eval/success")):
            steps, values = zip(*r.curves["eval/success"], strict=True)
            ax.plot(steps, values, linewidth=1, label=f"seed {r.seed}")
        for m in exp.marks:
            ax.axvline(m, color="grey", linestyle="--", linewidth=1)
        ax.set_title(arm, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(arms) :]:
        ax.axis("off")
    axes[0][0].set_ylabel("held-out success")
    axes[0][0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"{exp.name}: held-out success of every seed", fontsize=9)
    fig.tight_layout()
    path = out_dir / "eval_success_seeds.png"
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return path
