"""What a run leaves behind: ``metrics.jsonl``, TensorBoard events (and W&B
when asked), a rich live view, ``summary.json`` and PNG plots."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

PLOTS: dict[str, str] = {
    "train/reward_mean": "reward.png",
    "eval/success": "eval_success.png",
    "staleness/mean": "staleness.png",
    "dis/masked_frac": "masked_frac.png",
    "critic/explained_variance": "explained_variance.png",
}


class RunLogger:
    """Writes one JSON object per step and mirrors it to TensorBoard / W&B / the terminal."""

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        live: bool = True,
        config: dict[str, object] | None = None,
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
        self.console = Console()
        self._progress: Progress | None = None
        if live:
            self._progress = Progress(
                TextColumn("[bold]sao[/bold] step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, info="")
            self._progress.start()

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
        if self._progress is not None:
            info = " ".join(
                f"{label} {row[key]:.3f}"
                for key, label in [
                    ("train/reward_mean", "reward"),
                    ("eval/success", "eval"),
                    ("staleness/mean", "stale"),
                    ("dis/masked_frac", "masked"),
                    ("critic/explained_variance", "ev"),
                ]
                if key in row
            )
            self._progress.update(self._task, completed=step, info=info)

    def print(self, message: str) -> None:
        """A line above the live view."""
        self.console.print(message)

    def close(self) -> None:
        """Flush and close every sink (again: nothing happens)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


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
    for key in ("dropped/stale", "episodes/env_error", "idle/trainer_frac", "idle/rollout_frac"):
        if key in last:
            out[key] = last[key]
    return out


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
    return written
