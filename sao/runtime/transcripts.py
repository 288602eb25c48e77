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

The record and its file (:class:`Transcript`, :data:`EVAL_SAMPLES`,
:func:`last_evaluation`) live in :mod:`sao.rundir.transcripts`, what a run
leaves on disk; this module decodes episodes into them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from sao.rollout.chat import decode_reply
from sao.rundir.metrics import RunLogger
from sao.rundir.transcripts import EVAL_SAMPLES, Transcript, append_transcripts, last_evaluation
from sao.types import FAILURES, Trajectory

__all__ = [
    "CONSOLE_SAMPLES",
    "EVAL_SAMPLES",
    "EvalSamples",
    "Transcript",
    "last_evaluation",
    "transcripts",
]

CONSOLE_SAMPLES = 2
"""Transcripts of each evaluation shown on the console."""


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
        rows = append_transcripts(self.path, found)
        for t in found[:CONSOLE_SAMPLES]:
            self.logger.print(t.line())
        self.logger.table("eval/samples", step, rows)
        return found
