"""Where failed episodes are recorded: ``RUN_DIR/failures.jsonl`` (every one,
with its reason and message, and the step it would have been trained in:
rows after a checkpoint are rewound on resume, like metrics) and the terminal
(the first few of each reason, then a count now and then, so a failing task
never floods the output)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from sao.types import FAILURES as FAILURES_REASONS
from sao.types import Trajectory

__all__ = ["FAILURES", "FailureLog"]

FAILURES = "failures.jsonl"
"""The run directory's record of failed episodes."""


class FailureLog:
    """Records failed episodes (an :data:`~sao.runtime.orchestrator.Report`)."""

    def __init__(
        self, path: Path, echo: Callable[[str], None], *, shown: int = 3, every: int = 100
    ) -> None:
        self.path, self.echo, self.shown, self.every = path, echo, shown, every
        self.counts: Counter[str] = Counter()

    def __call__(self, traj: Trajectory, step: int) -> None:
        if traj.finish_reason not in FAILURES_REASONS:  # a warning about a trained episode
            self.echo(f"episode {traj.prompt_id} (trained; a warning): {traj.error}")
            return
        reason = traj.finish_reason
        self.counts[reason] += 1
        row = {
            "step": step,
            "prompt_id": traj.prompt_id,
            "reason": reason,
            "error": traj.error,
            "tokens": traj.num_tokens,
            "turns": traj.num_turns,
        }
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        n = self.counts[reason]
        if n <= self.shown:
            more = " (further ones are only counted)" if n == self.shown else ""
            self.echo(f"episode {traj.prompt_id} failed ({reason}): {traj.error}{more}")
        elif n % self.every == 0:
            self.echo(f"{n} episodes failed with {reason} so far (all in {self.path.name})")
