"""Token in, token out, checked once per episode (``rollout.tito_check``).

At the end of every episode that would be trained (finish ``stop`` or
``length``) ``run_episode`` checks two things, off the event loop:

1. **The stream** (:func:`check_stream`). Every ``Engine.generate`` call was
   recorded (:class:`GenerationLog`): its prompt ids must be a prefix of the
   trajectory's tokens, its sampled ids must sit right after that prefix,
   marked as actions, with the engine's log-probabilities and versions, and no
   other token may be marked as an action. The trainer then sees exactly the
   tokens the engine conditioned on and sampled. Any difference is a
   **mismatch** (a bug: nothing legitimate produces one).
2. **The template** (:func:`check_render`). The final conversation (the
   messages the environment saw, replies as decoded text) rendered by the
   chat template, ``apply_chat_template(messages, tokenize=False)``, is
   compared with the token history read as text. The history alternates
   segments the loop tokenized (the prompt, each observation) with replies
   the model sampled. Every segment must appear in the rendering, in order,
   with exactly the text the loop gave it (a generation prompt at its end,
   e.g. ``<|im_start|>assistant\\n``, counts with the reply after it);
   otherwise it is a **mismatch**: the model trained on a history the
   template never writes for this conversation. Between two segments the
   rendering may show a reply differently from how it was sampled: Qwen3 and
   DeepSeek drop the reasoning of earlier replies, Llama and Mistral trim
   them, DeepSeek's generation prompt opens a ``<think>`` block its history
   never shows, a sampled special token is not in the decoded text. That is
   a **rewrite**, counted but legitimate: the history keeps the tokens as
   sampled. Texts are compared, not ids: a sampled reply need not be the
   tokenizer's own encoding of its text (a model may sample ``"h", "i"``
   for ``"hi"``), and that is no difference at all.

The first difference is reported with its token position in the trajectory
and a short excerpt of both sides. The template check is skipped (the stream
is still checked) without a chat template, or when an observation was token
ids (the environment owns those).

Policies (:data:`TitoPolicy`) for a mismatch: ``warn`` trains the episode and
names it (``Trajectory.error``; the orchestrator logs the first),
``drop`` makes it a failure (finish ``error``), ``stop`` makes it a failure
and stops the run (the orchestrator raises ``RunStopped``), ``off`` checks
nothing. Trajectory metrics: ``tito/checked``, ``tito/mismatch``,
``tito/rewrite`` (0 or 1), and ``tito/stop`` under ``stop``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import TYPE_CHECKING, Literal

from sao.rollout.chat import (
    decode_reply,
    excerpt,
    first_difference,
    has_chat_template,
    render,
)
from sao.rollout.engine import Engine
from sao.rollout.envcall import describe_error
from sao.rollout.weights import WeightSource
from sao.types import Completion, Message, SamplingParams, Trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "TITO_POLICIES",
    "Finding",
    "Generation",
    "GenerationLog",
    "TitoPolicy",
    "check_episode",
    "check_render",
    "check_stream",
    "judge",
]

TitoPolicy = Literal["warn", "drop", "stop", "off"]
TITO_POLICIES: tuple[TitoPolicy, ...] = ("warn", "drop", "stop", "off")


@dataclass(frozen=True)
class Generation:
    """One ``Engine.generate`` call as the engine saw it."""

    prompt: tuple[int, ...]
    completion: Completion


class GenerationLog:
    """An :class:`~sao.rollout.engine.Engine` that records every generate call
    of ``engine`` (any other attribute, e.g. ``max_seq_len``, is the engine's)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.generations: list[Generation] = []

    def __getattr__(self, name: str) -> object:
        if name == "engine":  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.engine, name)

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def weight_sources(self) -> tuple[type, ...]:
        return self.engine.weight_sources

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        prompt = tuple(prompt_ids)
        completion = await self.engine.generate(prompt, sampling)
        if isinstance(completion, Completion):  # anything else is the loop's to reject
            self.generations.append(Generation(prompt, completion))
        return completion

    async def update_weights(self, source: WeightSource) -> None:
        await self.engine.update_weights(source)

    async def aclose(self) -> None:
        await self.engine.aclose()


@dataclass(frozen=True)
class Finding:
    """What a check found: ``match``, ``rewrite`` (legitimate) or ``mismatch``;
    ``position`` is the trajectory token of the first difference (-1: none)."""

    kind: Literal["match", "rewrite", "mismatch"]
    message: str = ""
    position: int = -1
    notes: tuple[str, ...] = field(default=())


MATCH = Finding("match")


def _tokens_around(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], at: int) -> str:
    before = decode_reply(tokenizer, ids[max(0, at - 6) : at], skip_special_tokens=False)
    after = decode_reply(tokenizer, ids[at : at + 6], skip_special_tokens=False)
    return f"{before!r} ▸ {after!r}"


def check_stream(
    tokenizer: PreTrainedTokenizerBase,
    traj: Trajectory,
    generations: Sequence[Generation],
    *,
    complete: bool,
) -> Finding:
    """Every recorded generation's prompt is a prefix of ``traj.tokens`` and its
    sampled ids, log-probs and versions sit right after it, as actions; with
    ``complete`` (the episode was not resumed) no other token is an action."""
    tokens, sampled = traj.tokens, [False] * traj.num_tokens
    for i, gen in enumerate(generations, 1):
        n, c = len(gen.prompt), gen.completion
        span = slice(n, n + len(c.token_ids))
        if tokens[:n] != gen.prompt:
            at = first_difference(tokens, gen.prompt)
            return Finding(
                "mismatch",
                f"generate call {i}'s prompt ({n} tokens) is not a prefix of the trajectory "
                f"({len(tokens)} tokens): they differ at token {at}: the trajectory has "
                f"{_tokens_around(tokenizer, tokens, at)}, the prompt "
                f"{_tokens_around(tokenizer, gen.prompt, at)}",
                at,
            )
        got = (tokens[span], traj.rollout_logp[span], traj.versions[span])
        if got != (c.token_ids, c.logprobs, c.versions) or not all(traj.action_mask[span]):
            return Finding(
                "mismatch",
                f"generate call {i} sampled {len(c.token_ids)} tokens after its {n}-token "
                "prompt, but the trajectory does not hold them there as actions with their "
                "log-probabilities and versions",
                n,
            )
        sampled[span] = [True] * len(c.token_ids)
    stray = [i for i, (a, s) in enumerate(zip(traj.action_mask, sampled, strict=True)) if a > s]
    if complete and stray:
        return Finding(
            "mismatch",
            f"token {stray[0]} ({_tokens_around(tokenizer, tokens, stray[0])}) is marked as "
            "an action, but no generate call sampled it",
            stray[0],
        )
    return MATCH


def _token_at(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], char: int) -> int:
    """The index of the token of ``ids`` whose text holds character ``char``."""
    lo, hi = 0, len(ids)  # the shortest prefix whose text is longer than ``char``
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode_reply(tokenizer, ids[: mid + 1], skip_special_tokens=False)) > char:
            hi = mid
        else:
            lo = mid + 1
    return min(lo, max(len(ids) - 1, 0))


def _longest_found(text: str, part: str, start: int) -> tuple[int, int]:
    """Where the longest prefix of ``part`` occurs in ``text`` from ``start``,
    and its length (binary search: a prefix that occurs has shorter ones that do)."""
    lo, hi = 0, len(part)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.find(part[:mid], start) >= 0:
            lo = mid
        else:
            hi = mid - 1
    return text.find(part[:lo], start), lo


def _generation_prompt(tokenizer: PreTrainedTokenizerBase, first: Sequence[Message]) -> str:
    """The text ``add_generation_prompt=True`` appends after ``first`` ('' if unclear)."""
    with_prompt = render(tokenizer, first, where="the check")
    without = render(tokenizer, first, where="the check", generation_prompt=False)
    return with_prompt[len(without) :] if with_prompt.startswith(without) else ""


def _segments(traj: Trajectory) -> list[tuple[int, int]]:
    """Token spans the loop tokenized: the prompt, then each observation."""
    turns = traj.turns
    return [(0, turns[0].start)] + [(t.end, t.obs_end) for t in turns[:-1]]


def _comparable(messages: Sequence[Message], traj: Trajectory) -> bool:
    """One assistant message per turn, and a message between any two replies
    (an observation of token ids leaves none: the template cannot show it)."""
    roles = [m.role for m in messages]
    if not traj.turns or roles.count("assistant") != len(traj.turns) or roles[0] == "assistant":
        return False
    return all(not (a == b == "assistant") for a, b in pairwise(roles))


def _reply_rewrite(
    tokenizer: PreTrainedTokenizerBase,
    traj: Trajectory,
    k: int,
    lead: str,
    shown: str,
    *,
    last: bool,
) -> Finding | None:
    """A rewrite when the template shows reply ``k`` (after the generation
    prompt ``lead``) other than as sampled; the last reply may be followed by more."""
    turn = traj.turns[k]
    reply = traj.tokens[turn.start : turn.end]
    sampled = lead + decode_reply(tokenizer, reply, skip_special_tokens=False)
    if shown == sampled or (last and shown.startswith(sampled)):
        return None
    c = first_difference(sampled, shown)
    at = turn.start + (_token_at(tokenizer, reply, c - len(lead)) if c >= len(lead) else 0)
    return Finding(
        "rewrite",
        f"the chat template shows reply {k + 1} (tokens [{turn.start}, {turn.end})) other "
        f"than as sampled, from token {at}: sampled {excerpt(sampled, c)}, rendered "
        f"{excerpt(shown, c)}",
        at,
    )


def _segment_mismatch(
    tokenizer: PreTrainedTokenizerBase,
    traj: Trajectory,
    k: int,
    core: str,
    rendered: str,
    pos: int,
) -> Finding:
    """Segment ``k`` (0: the prompt) does not occur in ``rendered`` after ``pos``."""
    a, b = _segments(traj)[k]
    found, n = _longest_found(rendered, core, pos) if k else (0, first_difference(core, rendered))
    at = a + _token_at(tokenizer, traj.tokens[a:b], n)
    what = "the prompt" if k == 0 else f"the observation after reply {k}"
    return Finding(
        "mismatch",
        f"{what} (tokens [{a}, {b})) is not what the chat template writes for the final "
        f"conversation: from token {at} the history has {excerpt(core, n)}, the template "
        f"{excerpt(rendered, found + n)}",
        at,
    )


def check_render(
    tokenizer: PreTrainedTokenizerBase, traj: Trajectory, messages: Sequence[Message]
) -> Finding:
    """The token history against the chat template's rendering of the final
    conversation ``messages`` (see the module docstring): ``match``,
    ``rewrite`` (the first reply shown otherwise) or ``mismatch`` (the first
    prompt or observation segment the template does not write)."""
    if not has_chat_template(tokenizer) or not _comparable(messages, traj):
        return Finding("match", notes=("not compared with the template",))
    first = next(i for i, m in enumerate(messages) if m.role == "assistant")
    head = _generation_prompt(tokenizer, messages[:first])
    rendered = render(tokenizer, messages, where="the check", generation_prompt=False)
    pos, lead, rewrite = 0, "", None
    for k, (a, b) in enumerate(_segments(traj)):
        text = decode_reply(tokenizer, traj.tokens[a:b], skip_special_tokens=False)
        tail = head if head and text.endswith(head) else ""
        core = text[: len(text) - len(tail)]
        at = rendered.find(core, pos) if k else (0 if rendered.startswith(core) else -1)
        if at < 0:
            return _segment_mismatch(tokenizer, traj, k, core, rendered, pos)
        if k and rewrite is None:
            rewrite = _reply_rewrite(tokenizer, traj, k - 1, lead, rendered[pos:at], last=False)
        pos, lead = at + len(core), tail
    if rewrite is None:
        k = len(traj.turns) - 1
        rewrite = _reply_rewrite(tokenizer, traj, k, lead, rendered[pos:], last=True)
    return rewrite or MATCH


def check_episode(
    tokenizer: PreTrainedTokenizerBase,
    traj: Trajectory,
    messages: Sequence[Message],
    generations: Sequence[Generation],
    *,
    complete: bool,
) -> Finding:
    """:func:`check_stream`, then :func:`check_render`; a check that cannot run
    (the template fails on the final conversation) is a mismatch."""
    try:
        found = check_stream(tokenizer, traj, generations, complete=complete)
        return found if found.kind == "mismatch" else check_render(tokenizer, traj, messages)
    except Exception as err:
        return Finding("mismatch", f"the check could not run: {describe_error(err)}")


def judge(traj: Trajectory, found: Finding, policy: TitoPolicy) -> Trajectory:
    """``traj`` with the check's metrics and, for a mismatch, ``policy`` applied
    (see the module docstring)."""
    metrics = {
        **traj.metrics,
        "tito/checked": 1.0,
        "tito/mismatch": float(found.kind == "mismatch"),
        "tito/rewrite": float(found.kind == "rewrite"),
    }
    if found.kind != "mismatch":
        return replace(traj, metrics=metrics)
    why = f"token-in/token-out check (rollout.tito_check={policy}): {found.message}"
    error = why if traj.error is None else f"{traj.error}; {why}"
    if policy == "warn":
        return replace(traj, error=error, metrics=metrics)
    if policy == "stop":
        metrics["tito/stop"] = 1.0
    return replace(traj, finish_reason="error", error=error, metrics=metrics)
