"""Held-out transcripts on disk: the :class:`Transcript` record, one JSON
object per held-out episode in ``RUN_DIR/eval_samples.jsonl``, written
(:func:`append_transcripts`) and read back (:func:`last_evaluation`). Decoding
episodes into transcripts is :mod:`sao.runtime.transcripts`'s job."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sao.rundir.metrics import read_jsonl

__all__ = [
    "EVAL_SAMPLES",
    "Transcript",
    "append_transcripts",
    "last_evaluation",
]

EVAL_SAMPLES = "eval_samples.jsonl"
"""The transcripts' file in the run directory."""
SHOWN_CHARS = 200
"""Characters of a prompt or a reply shown on one line (the file keeps all)."""
SHOWN_ERROR_CHARS = 80
"""Characters of an episode's error shown on one line."""


@dataclass(frozen=True)
class Transcript:
    """One held-out episode as text.

    ``prompt`` is the decoded prompt (chat template included, special tokens
    dropped); ``reply`` everything after it: the policy's replies and, in a
    multi-turn episode, the observations between them. ``reward`` is the one
    evaluation counts (0 for a failed episode)."""

    step: int
    index: int
    prompt: str
    reply: str
    reward: float
    finish_reason: str
    error: str | None = None

    def to_dict(self) -> dict[str, object]:
        """The JSON object written to ``eval_samples.jsonl``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> Transcript:
        """A transcript read back from ``eval_samples.jsonl``."""
        return cls(
            step=int(row["step"]),
            index=int(row["index"]),
            prompt=str(row["prompt"]),
            reply=str(row["reply"]),
            reward=float(row["reward"]),
            finish_reason=str(row["finish_reason"]),
            error=None if row.get("error") is None else str(row["error"]),
        )

    def line(self, chars: int = SHOWN_CHARS) -> str:
        """One console line, e.g.
        ``eval sample 0 (step 20): reward 1.000 stop | '...16 - 45?' -> 'answer -29'``."""
        head = f"eval sample {self.index} (step {self.step}): reward {self.reward:.3f} "
        error = f" ({_cut(' '.join(self.error.split()), SHOWN_ERROR_CHARS)})" if self.error else ""
        head += self.finish_reason + error
        return f"{head} | {_shown(self.prompt, chars)} -> {_shown(self.reply, chars)}"

    def block(self) -> str:
        """The whole transcript on a few lines: a header, then the prompt and
        the reply, each line indented."""
        error = f" ({' '.join(self.error.split())})" if self.error else ""
        return "\n".join(
            [
                f"eval sample {self.index}: reward {self.reward:.3f} {self.finish_reason}{error}",
                "  prompt:",
                *(f"    {x}" for x in self.prompt.strip().splitlines()),
                "  reply:",
                *(f"    {x}" for x in self.reply.strip().splitlines()),
            ]
        )


def _cut(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 3] + "..."


def _shown(text: str, chars: int) -> str:
    """``text`` on one line, quoted (newlines as ``\\n``, so a reply of blank
    lines shows), its end kept when too long: a prompt's question and a
    reply's answer are at their ends."""
    if len(text) > chars:
        text = "..." + text[-(chars - 3) :]
    return repr(text)


def last_evaluation(path: Path) -> list[Transcript]:
    """The transcripts of the latest step in ``path`` (an ``eval_samples.jsonl``);
    [] when it does not exist."""
    rows = read_jsonl(path)
    if not rows:
        return []
    last = max(int(r["step"]) for r in rows)
    return [Transcript.from_dict(r) for r in rows if int(r["step"]) == last]


def append_transcripts(path: Path, found: Sequence[Transcript]) -> list[dict[str, object]]:
    """Append ``found`` to ``path`` (an ``eval_samples.jsonl``), one JSON object
    a line; returns the rows written."""
    rows = [t.to_dict() for t in found]
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return rows
