"""The run's ledger, ``RUN_DIR/ledger.jsonl`` (with ``log.ledger``): which
trajectories were trained at which step and what each checkpoint held,
appended and flushed as the run goes, and rewound on resume exactly like
``metrics.jsonl``, so that after any number of crashes and resumes it
describes the one history the run's weights went through.

Every row carries the ``step`` it belongs to:

- ``{"event": "start", "step": s}``: the run started (``s = 0``) or resumed
  from checkpoint ``s``.
- ``{"event": "train", "step": s, "ids": [...], "rejected": r}``: batch ``s``
  trained on trajectories of these prompt ids (a group's members share
  theirs). ``r`` is the staleness gate's running count of finished
  trajectories that will never be trained (dropped as stale, or filtered).
- ``{"event": "checkpoint", "step": s, "buffered": [...], "restart": [...],
  "next_index": n, "rejected": r}``: checkpoint ``s`` is about to be written,
  holding these finished trajectories, these prompt indices to start again,
  and the prompt stream at ``n``. (Written before the save: a save that does
  not finish makes the run resume from an earlier checkpoint, which rewinds
  this row away.)

:func:`check_ledger` checks what a crash must never break: no trajectory is
trained twice, and none that finished before a checkpoint is lost.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from sao.rundir.metrics import read_jsonl, repair_jsonl
from sao.types import StepFn, Trajectory

LEDGER = "ledger.jsonl"
"""The ledger's name in a run directory."""


class Ledger:
    """Appends the rows of the module docstring (a no-op when disabled)."""

    def __init__(self, path: Path | None) -> None:
        self._file: IO[str] | None = None
        if path is not None:
            repair_jsonl(path)  # a row torn by a kill would swallow the next one
            self._file = path.open("a")
        self._batch: list[str] = []

    @classmethod
    def open(cls, run_dir: Path, *, enabled: bool, start_step: int) -> Ledger:
        """The ledger of ``run_dir`` (None: disabled), with its ``start`` row."""
        ledger = cls(run_dir / LEDGER if enabled else None)
        ledger._write({"event": "start", "step": start_step})
        return ledger

    def recording(self, step_fn: StepFn) -> StepFn:
        """``step_fn``, remembering the prompt ids of the batch it trains."""

        async def step(batch: list[Trajectory], train_actor: bool) -> dict[str, float]:
            self._batch = [t.prompt_id for t in batch]
            return await step_fn(batch, train_actor)

        return step

    def trained(self, step: int, rejected: int) -> None:
        """Batch ``step`` (the last one :meth:`recording` saw) was trained."""
        self._write({"event": "train", "step": step, "ids": self._batch, "rejected": rejected})

    def checkpoint(
        self, step: int, state: dict[str, Any], buffered: Sequence[Trajectory], rejected: int
    ) -> None:
        """Checkpoint ``step`` of run state ``state`` is about to be written."""
        self._write(
            {
                "event": "checkpoint",
                "step": step,
                "buffered": [t.prompt_id for t in buffered],
                "restart": list(state["in_flight"]),
                "next_index": state["next_index"],
                "rejected": rejected,
            }
        )

    def _write(self, row: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass
class LedgerCheck:
    """What :func:`check_ledger` found; ``problems`` is empty for a sound run."""

    steps: int = 0
    trained: int = 0
    starts: int = 0
    checkpoints: int = 0
    problems: list[str] = field(default_factory=list)


def check_ledger(path: Path, *, group_size: int = 1) -> LedgerCheck:
    """Check a finished run's ledger (each prompt has ``group_size`` trajectories):

    1. batches were trained at steps 1, 2, ..., N, each once;
    2. no prompt had more than ``group_size`` trajectories trained;
    3. whatever a checkpoint held in its buffer was trained after it, or is
       still in the last checkpoint's buffer;
    4. every prompt the stream had started by the last checkpoint is trained,
       buffered or to be restarted there, ``group_size`` trajectories each.

    In 3 and 4, the gate's count of trajectories rejected since (dropped as
    stale or filtered) is the only shortfall allowed."""
    rows = read_jsonl(path)
    out = LedgerCheck(starts=sum(r["event"] == "start" for r in rows))
    train = [r for r in rows if r["event"] == "train"]
    ckpts = [r for r in rows if r["event"] == "checkpoint"]
    out.steps, out.checkpoints = len(train), len(ckpts)
    out.trained = sum(len(r["ids"]) for r in train)
    if [r["step"] for r in train] != list(range(1, len(train) + 1)):
        out.problems.append(f"trained steps are {[r['step'] for r in train]}, not 1..N once each")
    counts = Counter(i for r in train for i in r["ids"])
    twice = sorted(i for i, n in counts.items() if n > group_size)
    if twice:
        out.problems.append(f"trained more than {group_size} times: {twice}")
    if not ckpts:
        out.problems.append("no checkpoint row")
        return out
    last = ckpts[-1]
    for c in ckpts[:-1]:
        later = Counter(i for r in train if r["step"] > c["step"] for i in r["ids"])
        missing = Counter(c["buffered"]) - later - Counter(last["buffered"])
        if missing.total() > last["rejected"] - c["rejected"]:
            out.problems.append(f"buffered at checkpoint {c['step']}, never trained: {missing}")
    held = Counter(i for r in train if r["step"] <= last["step"] for i in r["ids"])
    held += Counter(last["buffered"])
    held += Counter({f"train/{i}": group_size for i in last["restart"]})
    started = Counter({f"train/{i}": group_size for i in range(last["next_index"])})
    if held - started:
        out.problems.append(f"accounted for more than once: {held - started}")
    if (started - held).total() > last["rejected"]:
        out.problems.append(f"started but lost: {started - held}")
    return out
