"""Held-out transcripts: what the policy said at each evaluation.

A reward can rise for the wrong reason (a policy that echoes ``16 - 45`` for
``What is 16 - 45?`` when the scorer accepts the whole reply), and only the
replies show it. Each held-out evaluation of a run appends one JSON object
per episode to ``RUN_DIR/eval_samples.jsonl``::

    {"step": 20, "index": 0, "prompt": "user\\nWhat is 16 - 45? ...",
     "reply": "answer -29", "reward": 1.0, "finish_reason": "stop", "error": null}

(the first ``log.eval_samples`` episodes by index, all of them when that is
None), prints the first :data:`CONSOLE_SAMPLES` of them, and logs them as a
W&B table (``eval/samples``) when W&B is on. The model card quotes the last
evaluation's first few, and ``sao eval --show N`` prints N.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from sao.rollout.chat import decode_reply
from sao.rundir.metrics import RunLogger, read_jsonl
from sao.types import FAILURES, Trajectory

__all__ = [
    "CONSOLE_SAMPLES",
    "EVAL_SAMPLES",
    "EvalSamples",
    "Transcript",
    "last_evaluation",
    "transcripts",
]

EVAL_SAMPLES = "eval_samples.jsonl"
"""The transcripts' file in the run directory."""
CONSOLE_SAMPLES = 2
"""Transcripts of each evaluation shown on the console."""
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


def transcripts(
    trajs: Sequence[Trajectory],
    tokenizer: PreTrainedTokenizerBase,
    *,
    step: int,
    limit: int | None = None,
) -> list[Transcript]:
    """The first ``limit`` (None: all) of ``trajs``, held-out episode ``i`` at
    position ``i``, decoded as text."""
    out = []
    for index, t in enumerate(trajs[:limit] if limit is not None else trajs):
        cut = t.turns[0].start if t.turns else len(t.tokens)
        failed = t.finish_reason in FAILURES
        out.append(
            Transcript(
                step=step,
                index=index,
                prompt=decode_reply(tokenizer, t.tokens[:cut]),
                reply=decode_reply(tokenizer, t.tokens[cut:]),
                reward=0.0 if failed else float(t.reward),
                finish_reason=t.finish_reason,
                error=t.error,
            )
        )
    return out


def last_evaluation(path: Path) -> list[Transcript]:
    """The transcripts of the latest step in ``path`` (an ``eval_samples.jsonl``);
    [] when it does not exist."""
    rows = read_jsonl(path)
    if not rows:
        return []
    last = max(int(r["step"]) for r in rows)
    return [Transcript.from_dict(r) for r in rows if int(r["step"]) == last]


class EvalSamples:
    """Where each evaluation's transcripts go: ``RUN_DIR/eval_samples.jsonl``,
    the console (a line each for the first :data:`CONSOLE_SAMPLES`, through
    ``logger.print``) and a W&B table of them all (``logger.table``, when W&B
    is on). ``limit``: ``log.eval_samples``."""

    def __init__(
        self,
        run_dir: Path,
        tokenizer: PreTrainedTokenizerBase,
        limit: int | None,
        logger: RunLogger,
    ) -> None:
        self.path = run_dir / EVAL_SAMPLES
        self.tokenizer, self.limit, self.logger = tokenizer, limit, logger

    def record(self, step: int, trajs: Sequence[Trajectory]) -> list[Transcript]:
        """Write, show and log the transcripts of the evaluation at ``step``."""
        found = transcripts(trajs, self.tokenizer, step=step, limit=self.limit)
        if not found:
            return found
        rows = [t.to_dict() for t in found]
        with self.path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        for t in found[:CONSOLE_SAMPLES]:
            self.logger.print(t.line())
        self.logger.table("eval/samples", step, rows)
        return found
