"""A reply's final answer, and the built-in scorers that compare it to a reference.

**Markers.** The answer is what follows the last line starting with
``answer`` (the last ``\\boxed{...}`` on it, if it holds one), else the last
``\\boxed{...}`` of the reply, else its last ``<answer>...</answer>`` tag
(:func:`extract_answer`). A reply with none of them has no answer and scores
0. ``require_marker=False`` takes the whole reply as the answer instead, which
is open to an *echo*: asked ``What is 16 - 45?``, a policy that replies
``16 - 45`` and stops is scored on ``16 - 45``, and math-verify evaluates it
to ``-29``, a match. A real checkpoint learned that in six steps; any dataset
whose question contains its own computation invites it.

**Values.** When the reference is a number (``-29``, ``0.5``, ``7/8``,
``\\frac{1}{2}``, ``50\\%``: :func:`is_value`), :func:`math_score` also wants
a number: ``16 - 45`` or ``3/4 + 1/8`` inside a marker scores 0, while other
forms of the same value (``\\boxed{1/2}`` for ``0.5``, ``-29.0``,
``\\frac{1}{2}``) still match. A reference that is not a number (``\\sqrt{2}``,
``x + 1``, ``16 - 45``) is compared by math-verify alone, and
``require_value=False`` turns the check off for datasets whose numeric
answers may be written as expressions.
"""

from __future__ import annotations

import re
import threading

__all__ = [
    "MISSING_ANSWER",
    "exact_score",
    "extract_answer",
    "is_value",
    "math_score",
]

MISSING_ANSWER = "metric/format/missing_answer"
"""``StepResult.info`` entry: 1.0 when the reply has no answer marker, else 0.0
(averaged into ``format/missing_answer`` per training batch and
``eval/format/missing_answer`` per evaluation)."""

_ANSWER_LINE = re.compile(r"^[ \t]*answer\b[ \t]*:?(?![ \t]*=)[ \t]*", re.IGNORECASE | re.MULTILINE)
_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_MAX_ANSWER_CHARS = 2000

_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_VALUE = re.compile(
    rf"[+\-]?(?:{_NUM}|(?:{_NUM})/(?:{_NUM})"
    rf"|\\[dt]?frac(?:\{{[+\-]?(?:{_NUM})\}}\{{(?:{_NUM})\}}|\d\d))%?"
)
"""A signed integer or decimal (``1,000`` grouping allowed), a fraction ``a/b``
or ``\\frac{a}{b}`` (``\\dfrac``, ``\\tfrac``, ``\\frac12``), a percentage."""
_SPACING = re.compile(r"\\[!,;: ]|\s+|\{,\}|\\left|\\right")
_WRAPPERS = ("$", "\\(", "\\)", "\\[", "\\]", "*", "`")
_UNIT = re.compile(r"\\(?:text|mbox|mathrm)\{[^{}]*\}$")
_LHS = re.compile(r"^[A-Za-z]=")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def extract_answer(response: str, *, require_marker: bool = True) -> str | None:
    """The final answer in a reply (the order is in the module docstring).

    None when the reply has no marker, or the marker holds nothing; with
    ``require_marker=False`` the whole reply (stripped) instead.
    """
    matches = list(_ANSWER_LINE.finditer(response))
    text = response[matches[-1].end() :] if matches else response
    found: str | None = text if matches else None
    boxed = _last_boxed(text)
    if boxed is not None:
        found = boxed
    elif not matches:
        tags = _TAG.findall(response)
        found = tags[-1] if tags else None
    if found is not None and found.strip():
        return found.strip()
    return None if require_marker else response.strip()


def _unwrap(text: str) -> str:
    """``text`` without surrounding ``$``, ``\\(...\\)``, Markdown ``**`` or
    backticks, nor a final full stop (any nesting: ``**$-29$**.``)."""
    s, before = text.strip(), ""
    while s != before:
        before = s
        for w in _WRAPPERS:
            s = s.removeprefix(w).removesuffix(w).rstrip(".").strip()
    return s


def is_value(text: str) -> bool:
    """True when ``text`` is written as one number rather than a computation:
    ``-29``, ``-29.0``, ``1,000``, ``1/2``, ``\\frac{1}{2}``, ``50\\%``, ``$0.5$``,
    ``x = 5``, ``5 \\text{ cm}``; not ``16 - 45``, ``3/4 + 1/8``, ``\\sqrt{4}``."""
    s = _SPACING.sub("", _UNIT.sub("", _unwrap(text)))
    s = _LHS.sub("", s.replace("\\%", "%").replace("−", "-"))
    return _VALUE.fullmatch(s) is not None


def _normalize(text: str) -> str:
    text = text.strip().strip("$").strip().rstrip(".").strip().strip("`'\"*").strip()
    return " ".join(text.lower().split())


def exact_score(response: str, answer: str, *, require_marker: bool = True) -> float:
    """1.0 iff the reply's final answer equals ``answer`` after normalisation
    (case, spaces, surrounding quotes or ``$``, a final full stop); 0.0 without one."""
    found = extract_answer(response, require_marker=require_marker)
    return 1.0 if found is not None and _normalize(found) == _normalize(answer) else 0.0


def math_score(
    response: str, answer: str, *, require_marker: bool = True, require_value: bool = True
) -> float:
    """1.0 iff math-verify finds the reply's final answer equivalent to ``answer``;
    0.0 without an answer, and (``require_value``) when ``answer`` is a number but
    the reply's answer is not (:func:`is_value`).

    Both sides are read as the content of a ``\\boxed{}``, so math-verify
    parses them as LaTeX: read bare, ``2\\sqrt{2}`` and ``2^{10}`` would be
    taken as ``2`` (and ``2`` would match them); text it cannot read so is read
    bare. Its own timeouts use ``SIGALRM``, which only works on the main
    thread; elsewhere they are off and answers are capped in length instead.
    """
    from math_verify import parse, verify  # optional dependency, imported on use

    main = threading.current_thread() is threading.main_thread()
    timeout = 5 if main else None

    def parsed(text: str) -> list[object]:
        text = _unwrap(text)[:_MAX_ANSWER_CHARS]
        boxed = parse(f"\\boxed{{{text}}}", parsing_timeout=timeout)
        if len(boxed) > 1:  # [expression, its text]; [text] alone: not parsed
            return boxed
        return parse(text, parsing_timeout=timeout) or boxed

    gold = parsed(answer)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {answer[:80]!r}")
    found = extract_answer(response, require_marker=require_marker)
    if found is None or (require_value and is_value(answer) and not is_value(found)):
        return 0.0
    pred = parsed(found)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0
