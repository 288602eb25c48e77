"""What a run leaves behind: ``metrics.jsonl``, TensorBoard events (and W&B /
MLflow when asked), terminal output (a rich live view on a terminal, plain
lines elsewhere), ``summary.json`` and PNG plots."""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

PLOTS: dict[str, str] = {
    "train/reward_mean": "reward.png",
    "eval/success": "eval_success.png",
    "staleness/mean": "staleness.png",
    "dis/masked_frac": "masked_frac.png",
    "critic/explained_variance": "explained_variance.png",
    "eval/critic_auc": "critic_auc.png",
    "critic/heldout_gain": "critic_heldout_gain.png",
}

HEADLINE: tuple[tuple[str, str], ...] = (
    ("train/reward_mean", "reward"),
    ("eval/success", "eval"),
    ("staleness/mean", "stale"),
    ("dis/masked_frac", "masked"),
    ("critic/explained_variance", "ev"),
)
"""What the terminal shows of a step, as (metric, label): live view and plain lines alike."""


def headline(row: Mapping[str, float]) -> str:
    """``reward 0.500 eval 0.250 ...``: the :data:`HEADLINE` metrics that ``row`` holds."""
    return " ".join(f"{label} {row[key]:.3f}" for key, label in HEADLINE if key in row)


class RunLogger:
    """Writes one JSON object per step and mirrors it to TensorBoard / W&B /
    MLflow / the terminal.

    ``live``: ``"auto"`` shows the rich live view when ``stream`` (stdout) is a
    terminal and plain lines otherwise (Slurm, CI, ``nohup``, a pipe: no
    control codes); True the live view, False plain lines, one every
    ``print_every`` steps (see :class:`PlainLines`)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        mlflow_experiment: str | None = None,
        live: bool | Literal["auto"] = "auto",
        print_every: int = 10,
        config: dict[str, object] | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        # resumed run: keep what was logged, without a line torn by a kill mid-write
        self.history: list[dict[str, float]] = repair_jsonl(self.path)
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("log.wandb=true needs `pip install sao[wandb]`") from e
            self._wandb = wandb.init(project=wandb_project, dir=str(run_dir), config=config)
        self._mlflow = MlflowRun(run_dir, mlflow_experiment, config) if mlflow_experiment else None
        stream = sys.stdout if stream is None else stream
        rich = stream.isatty() if live == "auto" else live
        self.view: LiveView | PlainLines = (
            LiveView(stream, total_steps) if rich else PlainLines(stream, total_steps, print_every)
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step's metrics everywhere."""
        row = {"step": step, **{k: _num(v) for k, v in metrics.items()}}
        self.history.append(row)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        if self._mlflow is not None:
            self._mlflow.log(step, row)
        self.view.show(step, row)

    def print(self, message: str) -> None:
        """A line above the live view (or between the plain lines)."""
        self.view.print(message)

    def table(self, key: str, step: int, rows: list[dict[str, object]]) -> None:
        """Rows of text (e.g. held-out transcripts) as a W&B table named ``key`` at
        ``step``, when W&B is on; the columns are the first row's keys."""
        if self._wandb is None or not rows:
            return
        import wandb

        names = list(rows[0])
        data = [[r.get(c) for c in names] for r in rows]
        columns: list[str | int] = list(names)
        self._wandb.log({key: wandb.Table(columns=columns, data=data)}, step=step)

    def close(self, *, failed: bool | None = None) -> None:
        """Flush and close every sink (again: nothing happens). ``failed`` marks
        the MLflow run FAILED rather than FINISHED; None: whether an exception is
        on its way out (a ``finally:`` after a crash or a stop)."""
        if failed is None:
            failed = sys.exc_info()[0] is not None
        self.view.close()
        self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._mlflow is not None:
            self._mlflow.close(failed=failed)
            self._mlflow = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(failed=exc is not None)


class LiveView:
    """The rich progress bar, step and :func:`headline` metrics (on a terminal)."""

    def __init__(self, stream: TextIO, total_steps: int) -> None:
        self.console = Console(file=stream)
        self._progress: Progress | None = Progress(
            TextColumn("[bold]sao[/bold] step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self._task = self._progress.add_task("train", total=total_steps, info="")
        self._progress.start()

    def show(self, step: int, row: Mapping[str, float]) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=headline(row))

    def print(self, message: str) -> None:
        # as it is: "[max_lag 1]" or a reply's "[cute]" is text, not rich markup; long lines
        # are left to the terminal to wrap (copied, they stay one line)
        self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class PlainLines:
    """The live view's fields as one plain line, flushed at once, for output
    that is not a terminal: ``sao step 10/100 reward 0.500 stale 0.300 0:00:12``
    (time since this process started logging, as the live view shows it).

    A line every ``every`` steps (0: none), and always for the first step this
    process trains, each held-out evaluation and the last step."""

    def __init__(self, stream: TextIO, total_steps: int, every: int) -> None:
        self.stream, self.total, self.every = stream, total_steps, every
        self.start = time.monotonic()
        self._trained = False  # a step > 0 was shown: the next is not the first

    def show(self, step: int, row: Mapping[str, float]) -> None:
        first = step > 0 and not self._trained
        self._trained |= step > 0
        if self.every <= 0:
            return
        if first or step % self.every == 0 or step >= self.total or "eval/success" in row:
            elapsed = datetime.timedelta(seconds=int(time.monotonic() - self.start))
            info = headline(row)
            self.print(f"sao step {step}/{self.total} {info + ' ' if info else ''}{elapsed}")

    def print(self, message: str) -> None:
        self.stream.write(message + "\n")
        self.stream.flush()  # a pipe is block-buffered: show each line as it happens

    def close(self) -> None:
        pass


class MlflowRun:
    """One MLflow run: the flattened config as params, then each step's finite
    metrics. Local by default (``RUN_DIR/mlruns``, a file store: MLflow's UI
    opens it with ``mlflow ui --backend-store-uri RUN_DIR/mlruns``); to
    ``MLFLOW_TRACKING_URI`` when that is set."""

    def __init__(self, run_dir: Path, experiment: str, config: Mapping[str, object] | None) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise RuntimeError("log.mlflow=true needs `pip install sao[mlflow]`") from e
        uri = None  # MlflowClient then reads MLFLOW_TRACKING_URI
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            uri = (run_dir / "mlruns").resolve().as_uri()
            # MLflow 3 keeps the file store "in maintenance mode" and refuses it unless
            # asked; it is the one local store that needs no database (SQLAlchemy)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        try:
            exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        except MlflowException:  # created meanwhile by another run on the same server
            found = self.client.get_experiment_by_name(experiment)
            if found is None:
                raise
            exp_id = found.experiment_id
        self.run_id: str = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
        params = [Param(k, v[:6000]) for k, v in flatten(config or {}).items()]  # value limit
        for i in range(0, len(params), 100):  # at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, row: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        metrics = [
            Metric(_MLFLOW_BAD.sub("_", k), v, ms, step)
            for k, v in row.items()
            if k != "step" and math.isfinite(v)
        ]
        for i in range(0, len(metrics), 1000):  # at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self, *, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


_MLFLOW_BAD = re.compile(r"[^\w\-. :/]")
"""Characters MLflow refuses in a metric name."""


def flatten(config: Mapping[str, object], prefix: str = "") -> dict[str, str]:
    """``{"train": {"steps": 3}}`` -> ``{"train.steps": "3"}``: strings as they
    are, other values as JSON (``true``, ``null``, ``[1, 2]``, ``{}``)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out |= flatten(value, name + ".")
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of an append-only JSON-lines file (``metrics.jsonl``,
    ``ledger.jsonl``); [] when it does not exist.

    A last line without its newline that is not JSON is a row torn by a kill
    mid-write: it is left out. Any other line that is not JSON means the file
    was damaged some other way, and raises :class:`ValueError` naming it."""
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")  # the last item is b"" after a complete row
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:  # no newline after it: torn
                break
            raise ValueError(
                f"{path} line {i + 1} is not JSON (the file is damaged; "
                f"delete that line to go on): {line[:80]!r}"
            ) from None
    return rows


def repair_jsonl(path: Path) -> list[dict[str, Any]]:
    """:func:`read_jsonl`, and rewrite the file (atomically) when its last
    line was torn, so that rows appended next start on a line of their own."""
    rows = read_jsonl(path)
    if path.is_file() and path.stat().st_size:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        if torn:
            write_jsonl(path, rows)
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace ``path`` with ``rows``, one per line (atomically)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def _num(v: object) -> float:
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return float("nan")


def summarize(history: list[dict[str, float]]) -> dict[str, float]:
    """Headline numbers of a run: first/last/best eval success, final reward, etc."""
    evals = [r["eval/success"] for r in history if "eval/success" in r]
    rewards = [r["train/reward_mean"] for r in history if "train/reward_mean" in r]
    last = history[-1] if history else {}
    out = {
        "steps": float(last.get("step", 0)),
        "wall_s": float(last.get("wall_s", 0.0)),
        "eval/success_first": evals[0] if evals else float("nan"),
        "eval/success_last": evals[-1] if evals else float("nan"),
        "eval/success_best": max(evals) if evals else float("nan"),
        "train/reward_first10": sum(rewards[:10]) / max(len(rewards[:10]), 1),
        "train/reward_last10": sum(rewards[-10:]) / max(len(rewards[-10:]), 1),
    }
    peaks = [r["memory/peak_gib"] for r in history if "memory/peak_gib" in r]
    if peaks:  # resident memory of the run's processes at its highest (sao.runtime.memory)
        out["memory/peak_gib"] = max(peaks)
    for key in ("dropped/stale", "episodes/env_error", "idle/trainer_frac", "idle/rollout_frac"):
        if key in last:
            out[key] = last[key]
    # the critic on held-out prompts and at each turn's start, and what the environments
    # reported of the held-out episodes (``eval/guess/in_interval``): first and last
    keys = {k for r in history for k in r if k.startswith("eval/") and k not in _EVAL_OWN}
    for key in sorted(keys):
        seen = [r[key] for r in history if key in r and math.isfinite(r[key])]
        if seen:
            out[f"{key}_first"], out[f"{key}_last"] = seen[0], seen[-1]
    return out


_EVAL_OWN = ("eval/success", "eval/reward_mean", "eval/env_error", "eval/timeout", "eval/error")
"""The evaluation's own counters (the summary has success's first, last and best)."""

_BY_TURN = re.compile(r"^eval/critic_auc_turn(\d+)$")


def _critic_by_turn(history: list[dict[str, float]], plt: Any, path: Path) -> bool:
    """The critic's held-out AUC at the start of each turn, one line per evaluation
    (at most 6, spread over the run): does it rank episodes better once earlier
    turns have revealed more? False when no evaluation has two turns."""
    rows = []
    for r in history:
        pts = sorted(
            (int(m[1]), v) for k, v in r.items() if (m := _BY_TURN.match(k)) and math.isfinite(v)
        )
        if len(pts) >= 2:
            rows.append((r["step"], pts))
    if not rows:
        return False
    if len(rows) > 6:
        rows = [rows[round(i * (len(rows) - 1) / 5)] for i in range(6)]
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=110)
    for step, pts in rows:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=f"step {step:g}")
    ax.axhline(0.5, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("turn")
    ax.set_ylabel("held-out critic AUC at the turn's start")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_plots(history: list[dict[str, float]], out_dir: Path) -> list[Path]:
    """One PNG per headline metric against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, name in PLOTS.items():
        pts = [(r["step"], r[key]) for r in history if key in r and math.isfinite(r[key])]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=110)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 40 else None)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    if _critic_by_turn(history, plt, out_dir / "critic_by_turn.png"):
        written.append(out_dir / "critic_by_turn.png")
    return written
