"""The model card of a run's export (``RUN_DIR/final/README.md``, as the
Hugging Face Hub reads it): what was trained, how, for how long, the held-out
results and the whole configuration, so that the directory explains itself
wherever it is copied."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import yaml

from sao.config import Config, to_dict
from sao.rundir.checkpoint import write_text_atomic
from sao.rundir.metrics import summarize
from sao.rundir.transcripts import EVAL_SAMPLES, Transcript

CARD = "README.md"
"""The model card's file name in the export."""
CARD_SAMPLES = 3
"""Held-out transcripts of the last evaluation quoted in the card."""
CARD_CHARS = 1000
"""Characters of a quoted prompt (its end) or reply (its start)."""


class Exporter(Protocol):
    """What writes the trained policy: a trainer handle
    (:class:`~sao.runtime.trainers.TrainerHandle`) has this method."""

    async def export(self, directory: Path) -> None:
        """The trained policy and tokenizer in Hugging Face format."""
        ...


async def export_final(
    handle: Exporter,
    directory: Path,
    cfg: Config,
    history: list[dict[str, float]],
    *,
    stopped: str | None = None,
    samples: Sequence[Transcript] = (),
) -> None:
    """The trained policy and tokenizer (``handle.export``, atomically), then
    its model card (atomically too: a kill between the two leaves a policy
    without a card, which finishing the run by resuming exports again).
    ``stopped``: why the run ended early (the card says so); ``samples``: the
    last evaluation's transcripts (the card quotes a few)."""
    await handle.export(directory)
    card = model_card(cfg, history, stopped=stopped, samples=samples)
    write_text_atomic(directory / CARD, card)


def model_card(
    cfg: Config,
    history: list[dict[str, float]],
    *,
    stopped: str | None = None,
    samples: Sequence[Transcript] = (),
) -> str:
    """The card's Markdown: YAML front matter (Hub metadata), the task and
    algorithm, steps and trajectories trained, first/last/best held-out
    success (from ``history``, the rows of ``metrics.jsonl``), what the
    replies look like (the first :data:`CARD_SAMPLES` of ``samples``) and the
    config."""
    summary = summarize(history)
    lines = [
        *_front_matter(cfg),
        *_training(cfg, summary, stopped),
        *_held_out(cfg, history),
        *_replies(samples),
        "## Configuration",
        "",
        "The resolved configuration (the run's `config.yaml`):",
        "",
        "```yaml",
        yaml.safe_dump(to_dict(cfg), sort_keys=False).strip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def _front_matter(cfg: Config) -> list[str]:
    """The YAML front matter (Hub metadata), the title and what was trained how."""
    algo = cfg.algo.resolve()
    start = f"`{cfg.model.path}`" if cfg.model.path else "the task's tiny warm-started policy"
    front = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": list(
            dict.fromkeys(["sao", "reinforcement-learning", cfg.task.name, cfg.algo.preset])
        ),
    }
    return [
        "---",
        yaml.safe_dump(front, sort_keys=False).strip(),
        "---",
        "",
        f"# `{cfg.task.name}` policy trained with sao",
        "",
        f"Trained by `sao train` (asynchronous RL for language-model agents) from {start} "
        f"on the `{cfg.task.name}` task, with the `{cfg.algo.preset}` algorithm preset: "
        f"advantage `{algo.advantage}`, loss `{algo.loss}`, "
        f"{'a critic' if algo.use_critic else 'no critic'}, "
        f"at most {cfg.runtime.max_lag} version(s) of staleness (`runtime.max_lag`).",
        "",
    ]


def _training(cfg: Config, summary: dict[str, float], stopped: str | None) -> list[str]:
    """Why the run stopped early (if it did), and the steps, trajectories and time trained."""
    algo = cfg.algo.resolve()
    total = cfg.train.steps + algo.critic_pretrain_steps
    steps = int(summary["steps"])
    lines = []
    if stopped is not None:
        reason = " ".join(stopped.split())
        lines += [
            f"**The run stopped early**, after step {steps} of {total}: {reason}",
            "These are the weights it had when it stopped.",
            "",
        ]
    return [
        *lines,
        "| training | |",
        "|---|---|",
        f"| steps | {steps} of {total} ({algo.critic_pretrain_steps} critic-only warm-up) |",
        f"| trajectories trained | {steps * cfg.train.batch_size} "
        f"({cfg.train.batch_size} per step) |",
        f"| wall time | {summary['wall_s']:.1f} s |",
        "",
    ]


def _held_out(cfg: Config, history: list[dict[str, float]]) -> list[str]:
    """The held-out results section: first, last and best ``eval/success``."""
    evals = [(int(r["step"]), r["eval/success"]) for r in history if "eval/success" in r]
    out = ["## Held-out results", ""]
    if not evals:
        return [*out, "No held-out evaluation was logged.", ""]
    best = max(evals, key=lambda e: e[1])  # the first of equal bests
    out += [
        f"`eval/success` on {cfg.eval.episodes} held-out episodes (greedy), "
        f"every {cfg.eval.every} steps:",
        "",
        "| | step | eval/success |",
        "|---|---|---|",
    ]
    for name, (step, value) in (("first", evals[0]), ("last", evals[-1]), ("best", best)):
        out.append(f"| {name} | {step} | {value:.3f} |")
    return [*out, ""]


def _replies(samples: Sequence[Transcript]) -> list[str]:
    """The section quoting the first :data:`CARD_SAMPLES` held-out transcripts."""
    out = ["## What the replies look like", ""]
    if not samples:
        return [*out, "No held-out transcripts were recorded (`log.eval_samples`).", ""]
    shown = samples[:CARD_SAMPLES]
    out += [
        f"The first {len(shown)} held-out episodes of the last evaluation (step "
        f"{shown[0].step}; the run's `{EVAL_SAMPLES}` holds {len(samples)} of them):",
        "",
    ]
    for t in shown:
        prompt = t.prompt if len(t.prompt) <= CARD_CHARS else "..." + t.prompt[-CARD_CHARS:]
        reply = t.reply if len(t.reply) <= CARD_CHARS else t.reply[:CARD_CHARS] + "..."
        error = f", {' '.join(t.error.split())}" if t.error else ""
        out += [
            f"Episode {t.index}: reward {t.reward:.3f}, `{t.finish_reason}`{error}",
            "",
            *_fenced(prompt.strip()),
            "",
            *_fenced(reply.strip() or f"(no visible text: {reply!r})"),
            "",
        ]
    return out


def _fenced(text: str) -> list[str]:
    """``text`` in a code fence longer than any run of backticks it holds."""
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    return [f"{fence}text", text, fence]
