"""The judges of ``style_shift``: the built-in deterministic one
(:func:`judge_text`, the style by marker words, :data:`MARKERS`) and an LLM
behind an OpenAI-compatible endpoint (:class:`OpenAIJudge`)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass

__all__ = [
    "JUDGE_PROMPT",
    "MARKERS",
    "MAX_TEXT",
    "STYLES",
    "BuiltinJudge",
    "Judge",
    "OpenAIJudge",
    "Verdict",
    "detect_style",
    "judge_text",
    "style_share",
    "style_tag",
    "style_votes",
    "words",
]

STYLES = ("academic", "cute", "chuunibyou", "classical")


def words(text: str) -> tuple[str, ...]:
    """The whitespace-separated words of ``text``."""
    return tuple(text.split())


MARKERS: dict[str, frozenset[str]] = {
    "academic": frozenset(
        words("thus furthermore moreover hence notably evidence analysis findings hypothesis")
    ),
    "cute": frozenset(words("uwu owo fluffy smol yay hehe teehee cozy nya sparkly cuddly")),
    "chuunibyou": frozenset(
        words("behold darkness sealed destiny abyss cursed forbidden awaken crimson fate")
    ),
    "classical": frozenset(words("thee thou thy hath doth yonder ere alas verily wherefore oft")),
}
"""Marker words per style (whole words, case-insensitive)."""
JUDGE_PROMPT = (
    "You grade a short text written about a topic. Reply with JSON only: "
    '{"quality": 1 or 0, "style": "academic" | "cute" | "chuunibyou" | "classical" | "none"}. '
    "quality is 1 if the text is fluent, on topic, 4-30 words and not repetitive; "
    "style is the text's writing style."
)
_TAG = re.compile(r"^\s*\[([A-Za-z]+)\]\s*(.*)$", re.DOTALL)
_WORD = re.compile(r"[a-z']+")
MAX_TEXT = 4000
"""Characters of a reply that are judged."""


def style_tag(text: str) -> str | None:
    """The known ``[style]`` tag ``text`` starts with, lower-cased, or None."""
    m = _TAG.match(text)
    return m.group(1).lower() if m is not None and m.group(1).lower() in STYLES else None


@dataclass(frozen=True)
class Verdict:
    """A judge's decision: binary quality, the detected style (or None) and why."""

    quality: bool
    style: str | None
    reason: str


def _tag_counts(text: str) -> tuple[str | None, dict[str, int]]:
    """The known ``[style]`` tag (or None) and the marker words per style in the
    body after it (in the whole text when there is no known tag)."""
    m = _TAG.match(text)
    tag = m.group(1).lower() if m is not None and m.group(1).lower() in STYLES else None
    body = m.group(2) if m is not None and tag is not None else text
    words = _WORD.findall(body.lower())
    return tag, {s: sum(w in MARKERS[s] for w in words) for s in STYLES}


def detect_style(text: str) -> str | None:
    """The declared ``[style]`` tag if the body uses more of its markers than of any other."""
    tag, counts = _tag_counts(text)
    if tag is None:
        return None
    best_other = max(c for s, c in counts.items() if s != tag)
    return tag if counts[tag] >= 1 and counts[tag] > best_other else None


def style_votes(text: str) -> dict[str, int]:
    """Votes per style: one for the declared ``[style]`` tag, one per marker word.

    Marker words are counted in the body after a known tag, or in the whole
    text when it has none (then there is no tag vote).
    """
    tag, counts = _tag_counts(text)
    return {s: counts[s] + int(s == tag) for s in STYLES}


def style_share(text: str, style: str) -> float:
    """The share of ``text``'s style votes (:func:`style_votes`) that ``style`` holds; 0
    when it has none. ``[cute] behold, red cats awaken the darkness`` holds 3 of 4
    chuunibyou votes (behold, awaken, darkness) and 1 of 4 cute ones (the tag)."""
    votes = style_votes(text)
    total = sum(votes.values())
    return votes[style] / total if total else 0.0


def judge_text(
    text: str, topic: str, *, min_words: int = 4, max_words: int = 30, max_chars: int = 240
) -> Verdict:
    """The built-in deterministic judge: quality checks in order, then the style."""
    style = detect_style(text)
    m = _TAG.match(text)
    if m is None or m.group(1).lower() not in STYLES:
        return Verdict(False, style, "no style tag")
    body = m.group(2).strip()
    words = _WORD.findall(body.lower())
    if not min_words <= len(words) <= max_words or len(body) > max_chars:
        return Verdict(False, style, f"length {len(words)} words, {len(body)} chars")
    if not all(line.isprintable() for line in body.splitlines()):
        return Verdict(False, style, "unprintable characters")
    top = max(words.count(w) for w in set(words))
    if top > 3 or len(set(words)) < 0.5 * len(words):
        return Verdict(False, style, "repetition")
    if re.search(rf"\b{re.escape(topic)}\b", body, re.IGNORECASE) is None:
        return Verdict(False, style, "off topic")
    return Verdict(True, style, "ok")


@dataclass(frozen=True)
class BuiltinJudge:
    """The deterministic judge (:func:`judge_text`) with its length bounds."""

    min_words: int = 4
    max_words: int = 30
    max_chars: int = 240

    async def judge(self, topic: str, text: str) -> Verdict:
        """Judge ``text`` written about ``topic``."""
        return judge_text(
            text,
            topic,
            min_words=self.min_words,
            max_words=self.max_words,
            max_chars=self.max_chars,
        )


@dataclass(frozen=True)
class OpenAIJudge:
    """An LLM judge behind an OpenAI-compatible ``/chat/completions`` endpoint.

    The API key is read from the environment variable ``api_key_env`` at call
    time (no header when unset). Errors never raise: they give a failing
    verdict whose reason records the error.
    """

    base_url: str
    model: str
    api_key_env: str = "OPENAI_API_KEY"
    timeout_s: float = 30.0

    async def judge(self, topic: str, text: str) -> Verdict:
        """Ask the endpoint for quality and style; any failure is a zero verdict."""
        try:
            reply = await asyncio.to_thread(self._request, topic, text)
            return _parse_judge_reply(reply)
        except Exception as err:  # network, HTTP, JSON or schema errors all score 0
            return Verdict(False, None, f"judge error: {type(err).__name__}: {err}"[:300])

    def _request(self, topic: str, text: str) -> str:
        payload = {
            "model": self.model,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": JUDGE_PROMPT},
                {"role": "user", "content": f"topic: {topic}\ntext: {text}"},
            ],
        }
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env, "")
        if key:
            headers["Authorization"] = f"Bearer {key}"
        url = self.base_url.rstrip("/") + "/chat/completions"
        req = urllib.request.Request(url, json.dumps(payload).encode(), headers, method="POST")
        host = urllib.parse.urlparse(url).hostname or ""
        # Local endpoints bypass any proxy configured in the environment.
        proxy = urllib.request.ProxyHandler({} if host in ("127.0.0.1", "localhost") else None)
        with urllib.request.build_opener(proxy).open(req, timeout=self.timeout_s) as resp:
            data = json.loads(resp.read(1_000_000).decode())
        return str(data["choices"][0]["message"]["content"])


def _parse_judge_reply(reply: str) -> Verdict:
    """Read ``{"quality": 0|1, "style": ...}`` from a judge reply."""
    m = re.search(r"\{.*\}", reply, re.DOTALL)
    if m is None:
        return Verdict(False, None, f"judge reply has no JSON object: {reply[:100]!r}")
    obj = json.loads(m.group(0))
    quality = obj["quality"] in (1, True, "1")
    style = str(obj.get("style", "none")).strip().lower()
    return Verdict(quality, style if style in STYLES else None, "llm judge")


Judge = BuiltinJudge | OpenAIJudge
