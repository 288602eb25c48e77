"""``style_shift``: the online-learning simulation (ALGORITHMS.md section 7).

A single-turn writing task. The policy picks one of four styles, declares it
with a tag and writes a short text about the topic::

    user:      write about red cats
    assistant: [cute] red cats are so fluffy and smol, yay!

Reward = quality x style match, each binary, from a deterministic judge
(:func:`judge_text`): *quality* needs a known ``[style]`` tag, 4-30 words,
at most 240 characters, printable text, the topic phrase, and no repetition
garbage; the *style* is the declared tag when the text uses more marker words
of that style (:data:`MARKERS`) than of any other, else none. The preferred
style follows a schedule over training steps (default cute from step 0,
chuunibyou from 133, classical from 266); the task is ``StepAware`` and every
env made after ``set_train_step`` judges with the then-current preference.
``make_eval_env(index, style)`` pins the preference for held-out evaluation
per style.

``credit="partial"`` (an option; the paper's reward is binary) replaces the
style match by the share of the text's style votes that the preferred style
holds (:func:`~sao.envs.style.judges.style_share`: the tag is one vote, each
marker word one), so a text that drifts toward the new style after a switch
earns something before it is wholly in that style; an episode succeeds when
the share is above one half. Optionally an LLM behind an OpenAI-compatible endpoint judges
quality and style instead (``judge="openai"``); any error gives reward 0 with
the reason kept in ``env.verdict.reason``.

Topics are "<adjective> <noun>" phrases; a phrase is held out iff
``blake2b(seed, phrase) % EVAL_SHARE == 0``, so eval topics are new
combinations of words seen in training and never appear in the train split.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict

from sao.envs._state import expect_same, read, read_optional
from sao.envs._tools import Transcript, as_observation, opening
from sao.envs.base import Conversation, Observation, Split, StepResult
from sao.envs.style.judges import (
    MARKERS,
    MAX_TEXT,
    STYLES,
    BuiltinJudge,
    Judge,
    OpenAIJudge,
    Verdict,
    detect_style,
    judge_text,
    style_share,
    style_tag,
    words,
)

__all__ = [
    "DEFAULT_SCHEDULE",
    "MARKERS",
    "STYLES",
    "BuiltinJudge",
    "OpenAIJudge",
    "StyleShiftEnv",
    "StyleShiftTask",
    "Verdict",
    "detect_style",
    "judge_text",
    "preferred_style",
]

CREDITS = ("binary", "partial")

DEFAULT_SCHEDULE: tuple[tuple[int, str], ...] = (
    (0, "cute"),
    (133, "chuunibyou"),
    (266, "classical"),
)
EVAL_SHARE = 8
ADJECTIVES = words(
    "old red blue green cold warm wild quiet lazy brave silver golden little busy sleepy gentle"
)
NOUNS = words(
    "cats dogs owls bees trains clocks rivers gardens stars clouds books boats apples candles "
    "bridges foxes hills lamps kites robots bells ships frogs roses"
)
SYSTEM_PROMPT = (
    "Write a short text (4-30 words) about the topic in one style. Start with the style tag: "
    "[academic], [cute], [chuunibyou] or [classical]."
)
FORMAT_HINT = "format: [cute] a short text about the topic"
TEMPLATES: dict[str, tuple[str, ...]] = {
    "academic": (
        "notably, {t} merit careful analysis; the evidence is thus clear.",
        "this study of {t} finds, moreover, strong evidence.",
        "{t} are, furthermore, a subject of careful analysis.",
    ),
    "cute": (
        "{t} are so fluffy and smol, yay!",
        "hehe, {t} make me happy uwu",
        "cozy {t} everywhere, teehee!",
    ),
    "chuunibyou": (
        "behold! {t} awaken the darkness within my sealed eye!",
        "{t} are bound to my cursed destiny.",
        "from the abyss, {t} grant me forbidden power!",
    ),
    "classical": (
        "o {t}, thou art fair as a summer day.",
        "yonder {t} doth rest ere the night, alas.",
        "verily, {t} hath a grace most noble.",
    ),
}
"""Demonstration templates per style; ``{t}`` is the topic."""


def _hash(*parts: object) -> int:
    """A stable 64-bit hash of ``parts`` (independent of PYTHONHASHSEED)."""
    data = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def preferred_style(schedule: Sequence[tuple[int, str]], step: int) -> str:
    """The style of the last schedule entry whose start step is ``<= step``."""
    style = schedule[0][1]
    for start, s in schedule:
        if start <= step:
            style = s
    return style


def _validate_schedule(schedule: Sequence[Sequence[object]]) -> tuple[tuple[int, str], ...]:
    """Normalise a schedule to ``((start_step, style), ...)`` or raise naming the fix."""
    out: list[tuple[int, str]] = []
    for entry in schedule:
        if len(entry) != 2 or not isinstance(entry[0], int) or entry[1] not in STYLES:
            raise ValueError(
                f"StyleShiftTask option schedule: entry {entry!r} must be (start_step, style) "
                f"with style in {STYLES}"
            )
        out.append((int(entry[0]), str(entry[1])))
    starts = [s for s, _ in out]
    if not out or starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)):
        raise ValueError(
            "StyleShiftTask option schedule: start steps must begin at 0 and increase strictly, "
            f"got {starts}"
        )
    return tuple(out)


def _read_verdict(state: Mapping[str, object]) -> Verdict:
    """A :class:`Verdict` from its ``asdict`` form in an env state."""
    style = read_optional(state, "style", str)
    return Verdict(read(state, "quality", bool), style, read(state, "reason", str))


class StyleShiftEnv:
    """One writing episode judged against a fixed preferred style."""

    def __init__(
        self,
        topic: str,
        preferred: str,
        *,
        judge: Judge,
        max_turns: int = 1,
        system: bool = False,
        credit: str = "binary",
    ) -> None:
        self.topic = topic
        self.preferred = preferred
        self.judge = judge
        self.credit = credit
        self.max_turns = max_turns
        self.system = system
        self.turns = 0
        self.text: str | None = None
        self.verdict: Verdict | None = None
        self.done = False

    @property
    def prompt(self) -> str:
        """The first user message."""
        return f"write about {self.topic}"

    def first_observation(self) -> Observation:
        """What ``reset`` returns: the prompt, after the system message if enabled."""
        return as_observation(opening(self.prompt, SYSTEM_PROMPT if self.system else None))

    async def reset(self, seed: int) -> Observation:
        """Start the episode; the topic is fixed, ``seed`` is unused."""
        self.turns = 0
        self.text = self.verdict = None
        self.done = False
        return self.first_observation()

    async def step(self, action: str) -> StepResult:
        """Judge the written text; an untagged text is retried while turns remain."""
        if self.done:
            return StepResult(None, done=True, info={"error": "episode is over"})
        self.turns += 1
        if style_tag(action) is None and self.turns < self.max_turns:
            return StepResult(FORMAT_HINT, info={"turns": self.turns, "wasted": 1})
        self.text = action[:MAX_TEXT]
        self.done = True
        self.verdict = await self.judge.judge(self.topic, self.text)
        info: dict[str, float | int | str] = {
            "quality": int(self.verdict.quality),
            "style": self.verdict.style or "none",
            "preferred": self.preferred,
            "reason": self.verdict.reason,
        }
        for style in STYLES:  # success under each preference (reward > 1/2)
            info[f"metric/style_{style}"] = float(self._credit(style) > 0.5)
        return StepResult(None, done=True, info=info)

    def _credit(self, style: str) -> float:
        v = self.verdict
        if v is None or not v.quality or self.text is None:
            return 0.0
        if self.credit == "partial":
            return style_share(self.text, style)
        return float(v.style == style)

    def score(self) -> float:
        """quality x (detected style == preferred style), or quality x the preferred
        style's share of the votes with ``credit="partial"``; 0 when nothing was judged."""
        return self._credit(self.preferred)

    def state_dict(self) -> dict[str, object]:
        """The episode so far (``RestorableEnv``), with its preferred style."""
        return {
            "topic": self.topic,
            "preferred": self.preferred,
            "turns": self.turns,
            "text": self.text,
            "verdict": None if self.verdict is None else asdict(self.verdict),
            "done": self.done,
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Continue the episode :meth:`state_dict` recorded (same topic only).

        The preferred style is restored, not checked: it was fixed when the
        episode began, and the resumed task's training step may since have
        moved the schedule on.
        """
        expect_same(state, "topic", self.topic)
        preferred, v = read(state, "preferred", str), read_optional(state, "verdict", dict)
        if preferred not in STYLES:
            raise ValueError(f"env state 'preferred': expected one of {STYLES}, got {preferred!r}")
        self.preferred = preferred
        self.turns = read(state, "turns", int)
        self.text = read_optional(state, "text", str)
        self.verdict = None if v is None else _read_verdict(v)
        self.done = read(state, "done", bool)


class StyleShiftTask:
    """The writing task whose preferred style shifts with training (``StepAware``).

    ``schedule`` lists ``(start_step, style)``; ``judge`` is ``"builtin"`` or
    ``"openai"`` (then ``judge_base_url`` and ``judge_model`` are required).
    ``max_turns > 1`` lets the policy retry an untagged text after a format
    hint. ``error_rate`` is the share of flawed demonstrations.
    ``credit`` is ``"binary"`` (the paper's quality x style match) or
    ``"partial"`` (quality x the preferred style's share of the style votes;
    built-in judge only).
    ``demo_lean`` is the weight of the schedule's first style among the
    demonstrations' styles (the others weigh 1 each): a warm start that leans
    toward the first audience's taste, as a pretrained model's prior would, so
    its greedy style is that style by a clear margin rather than by a tie
    among four equally likely styles. After each switch the policy must move.
    """

    name = "style_shift"

    def __init__(
        self,
        *,
        seed: int = 0,
        schedule: Sequence[tuple[int, str]] = DEFAULT_SCHEDULE,
        eval_size: int = 200,
        min_words: int = 4,
        max_words: int = 30,
        max_chars: int = 240,
        max_turns: int = 1,
        error_rate: float = 0.3,
        demo_lean: float = 2.0,
        credit: str = "binary",
        system: bool = False,
        judge: str = "builtin",
        judge_base_url: str = "",
        judge_model: str = "",
        judge_api_key_env: str = "OPENAI_API_KEY",
        judge_timeout_s: float = 30.0,
    ) -> None:
        self.schedule = _validate_schedule(schedule)
        _check(
            1 <= min_words <= max_words, "min_words/max_words", "need 1 <= min_words <= max_words"
        )
        _check(max_chars >= 8, "max_chars", "use 8 or more")
        _check(max_turns >= 1, "max_turns", "use 1 or more")
        _check(eval_size >= 1, "eval_size", "use 1 or more")
        _check(0.0 <= error_rate <= 1.0, "error_rate", "use a value in [0, 1]")
        _check(demo_lean > 0, "demo_lean", "use a weight > 0 (1 = all styles equally likely)")
        _check(credit in CREDITS, "credit", f"use one of {CREDITS}, got {credit!r}")
        _check(
            credit == "binary" or judge == "builtin",
            "credit",
            "'partial' needs the built-in judge (an LLM judge gives one style, not votes)",
        )
        self.judge: Judge
        if judge == "builtin":
            self.judge = BuiltinJudge(min_words, max_words, max_chars)
        elif judge == "openai":
            self.judge = _openai_judge(
                judge_base_url, judge_model, judge_api_key_env, judge_timeout_s
            )
        else:
            raise ValueError(
                f"StyleShiftTask option judge: use 'builtin' or 'openai', got {judge!r}"
            )
        self.seed = seed
        self._eval_size = eval_size
        self.max_turns = max_turns
        self.error_rate = error_rate
        self.credit = credit
        self.demo_weights = [demo_lean if s == self.schedule[0][1] else 1.0 for s in STYLES]
        self.system = system
        self.train_step = 0
        phrases = [f"{a} {n}" for a in ADJECTIVES for n in NOUNS]
        self.topics: dict[str, list[str]] = {
            split: [p for p in phrases if self.split_of(p) == split] for split in ("train", "eval")
        }

    @property
    def eval_size(self) -> int:
        """Number of held-out problems."""
        return self._eval_size

    @property
    def preferred(self) -> str:
        """The style preferred at the current training step."""
        return preferred_style(self.schedule, self.train_step)

    def set_train_step(self, step: int) -> None:
        """Record training progress; envs made afterwards judge with its preference."""
        self.train_step = step

    def split_of(self, topic: str) -> Split:
        """The split a topic phrase belongs to (a pure function of the phrase)."""
        return "eval" if _hash(self.seed, "split", topic) % EVAL_SHARE == 0 else "train"

    def topic(self, split: Split, index: int) -> str:
        """Topic of problem ``index``: hashed for train, cycled evenly for eval."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        pool = self.topics[split]
        i = index if split == "eval" else _hash(self.seed, split, index)
        return pool[i % len(pool)]

    def make_env(self, split: Split, index: int) -> StyleShiftEnv:
        """A fresh environment judged with the current preferred style."""
        return self._env(self.topic(split, index), self.preferred)

    def make_eval_env(self, index: int, style: str) -> StyleShiftEnv:
        """Held-out problem ``index`` judged against ``style`` (per-style evaluation)."""
        if style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {style!r}")
        return self._env(self.topic("eval", index), style)

    def _env(self, topic: str, preferred: str) -> StyleShiftEnv:
        return StyleShiftEnv(
            topic,
            preferred,
            judge=self.judge,
            max_turns=self.max_turns,
            system=self.system,
            credit=self.credit,
        )

    def demonstrations(self, n: int, *, seed: int) -> list[Conversation]:
        """``n`` single-turn texts in styles drawn with ``demo_weights``; ``error_rate``
        of them are flawed (off topic, too short, repetitive, mismatched or untagged)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = random.Random(_hash(self.seed, "demos", seed))
        out: list[Conversation] = []
        for _ in range(n):
            env = self._env(self.topic("train", rng.randrange(10**9)), self.preferred)
            transcript = Transcript(opening(env.prompt, SYSTEM_PROMPT if self.system else None))
            transcript.record(self._demo_text(env.topic, rng), None)
            out.append(transcript.conversation())
        return out

    def _demo_text(self, topic: str, rng: random.Random) -> str:
        style = rng.choices(STYLES, weights=self.demo_weights)[0]
        body = rng.choice(TEMPLATES[style]).format(t=topic)
        if rng.random() >= self.error_rate:
            return f"[{style}] {body}"
        flaw = rng.choice(("off_topic", "short", "repeat", "mismatch", "untagged"))
        if flaw == "off_topic":
            other = rng.choice([t for t in self.topics["train"] if t != topic])
            return f"[{style}] " + rng.choice(TEMPLATES[style]).format(t=other)
        if flaw == "short":
            return f"[{style}] {topic}!"
        if flaw == "repeat":
            word = rng.choice(sorted(MARKERS[style]))
            return f"[{style}] {topic} " + " ".join([word] * 6)
        if flaw == "mismatch":
            return f"[{rng.choice([s for s in STYLES if s != style])}] {body}"
        return body


def _openai_judge(base_url: str, model: str, api_key_env: str, timeout_s: float) -> OpenAIJudge:
    """The LLM judge from the task's ``judge_*`` options, checked."""
    _check(
        base_url.startswith(("http://", "https://")),
        "judge_base_url",
        "give the endpoint, e.g. http://127.0.0.1:8000/v1",
    )
    _check(bool(model), "judge_model", "name the judge model")
    _check(timeout_s > 0, "judge_timeout_s", "use a positive number of seconds")
    return OpenAIJudge(base_url, model, api_key_env, timeout_s)


def _check(ok: bool, option: str, fix: str) -> None:
    """Raise a ``ValueError`` naming ``option`` when ``ok`` is false."""
    if not ok:
        raise ValueError(f"StyleShiftTask option {option}: {fix}")
