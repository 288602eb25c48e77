"""``python_tool``: small exact-answer problems solved by running Python.

The policy runs code in the sandbox (:mod:`sao.envs.sandbox`), reads its
output and answers. Environment feedback is sent with role ``user``. An
episode::

    user:      digit sum of 48213
    assistant: run print(sum(map(int,'48213')))
    user:      18
    assistant: answer 18

A tool call is ``run CODE`` (``CODE`` may span several lines) or a fenced
```` ```python ```` block, for chat models; the answer is a line ``answer X``
(outside any code block). The tool's observation is the program's stdout,
then the last line of its stderr (the exception), or ``(no output)``, or
``(stopped: REASON)``, cut to ``obs_chars``. A malformed reply, an empty
program or an empty answer gets a short hint and wastes a turn; the episode
ends at the first answer or after ``max_turns`` replies.

Problem kinds: ``mul`` (``17*23``), ``digitsum`` (``digit sum of 48213``),
``reverse`` (``reverse abcde``), ``count`` (``count a in banana``), ``sort``
(``sort dcba``). Score 1.0 iff the answer equals the expected text after
normalisation (surrounding spaces, quotes, backticks and a final full stop
removed; case ignored).

Train/eval disjointness: text ``t`` is held out iff ``blake2b(seed, t) %
EVAL_SHARE == 0``; ``make_env(split, i)`` keeps the first hashed candidate of
its split, so no eval problem text ever appears in the train split.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sao.envs._split import draw_problem, split_of, stable_hash
from sao.envs._state import expect_same, read, read_optional
from sao.envs._tools import Transcript, as_observation, clip, opening
from sao.envs.base import Conversation, Message, Observation, Split, StepResult
from sao.envs.sandbox import SandboxResult, run_python

__all__ = ["KINDS", "PythonToolEnv", "PythonToolTask", "parse_action"]

EVAL_SHARE = 10
SYSTEM_PROMPT = (
    "Solve the task with Python. Run code as 'run print(1+2)'; you see its output. "
    "Finish with 'answer X'."
)
FORMAT_HINT = "format: run print(1+2) or answer 3"
_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_RUN = re.compile(r"^run\b[ \t]*:?[ \t]*\n?(.*)$", re.DOTALL | re.IGNORECASE)
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")
_ANSWER = re.compile(r"^[ \t]*answer\b[ \t]*:?(?![ \t]*=)[ \t]*(.*)$", re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True)
class Problem:
    """One problem: its text, the expected answer, a correct program and a
    buggy one with that program's (known) output."""

    text: str
    answer: str
    code: str
    buggy_code: str
    buggy_output: str


def _word(rng: random.Random, lo: int = 4, hi: int = 7) -> str:
    return "".join(rng.choice(string.ascii_lowercase[:8]) for _ in range(rng.randint(lo, hi)))


def _mul(rng: random.Random) -> Problem:
    a, b = rng.randint(11, 99), rng.randint(11, 99)
    return Problem(f"{a}*{b}", str(a * b), f"print({a}*{b})", f"print({a}+{b})", str(a + b))


def _digitsum(rng: random.Random) -> Problem:
    n = str(rng.randint(10**4, 10**7))
    code = f"print(sum(map(int,'{n}')))"
    return Problem(
        f"digit sum of {n}", str(sum(map(int, n))), code, f"print(len('{n}'))", str(len(n))
    )


def _reverse(rng: random.Random) -> Problem:
    s = _word(rng)
    return Problem(f"reverse {s}", s[::-1], f"print('{s}'[::-1])", f"print('{s}'[1:])", s[1:])


def _count(rng: random.Random) -> Problem:
    s = _word(rng, 5, 9)
    c = rng.choice(s)
    code = f"print('{s}'.count('{c}'))"
    return Problem(f"count {c} in {s}", str(s.count(c)), code, f"print(len('{s}'))", str(len(s)))


def _sort(rng: random.Random) -> Problem:
    s = _word(rng)
    code = f"print(''.join(sorted('{s}')))"
    buggy = f"print(''.join(sorted('{s}'))[::-1])"
    return Problem(f"sort {s}", "".join(sorted(s)), code, buggy, "".join(sorted(s))[::-1])


KINDS: dict[str, Callable[[random.Random], Problem]] = {
    "mul": _mul,
    "digitsum": _digitsum,
    "reverse": _reverse,
    "count": _count,
    "sort": _sort,
}
"""Problem generators by kind."""


def normalize(text: str) -> str:
    """Canonical form of an answer: trimmed, unquoted, no final full stop, lower case."""
    text = text.strip().rstrip(".").strip().strip("`'\"*").strip()
    return " ".join(text.lower().split())


def parse_action(action: str) -> tuple[str, str] | None:
    """Read one reply as ``("run", code)`` or ``("answer", text)``, or None.

    A reply that starts with ``run`` is code; otherwise the last ``answer``
    line outside code blocks is the answer; otherwise a fenced block is code.
    """
    text = action.strip()
    m = _RUN.match(text)
    if m:
        return "run", m.group(1).strip("\n")
    answers = _ANSWER.findall(_FENCE.sub("", text))
    if answers:
        return "answer", answers[-1].strip()
    fence = _FENCE.search(text)
    if fence:
        return "run", fence.group(1).strip("\n")
    return None


def tool_observation(result: SandboxResult, obs_chars: int) -> str:
    """What the policy sees after running a program (see module docstring)."""
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    errors = [ln.strip() for ln in result.stderr.splitlines() if ln.strip()]
    if errors and result.exit_code not in (0, None):
        named = [ln for ln in errors if _EXCEPTION.match(ln)]
        parts.append((named or errors)[-1])
    status = ""
    if result.killed_reason and result.killed_reason != "leftover_processes":
        status = f"(stopped: {result.killed_reason})"
    if not parts:
        return clip(status or "(no output)", obs_chars)
    if not status:
        return clip("\n".join(parts), obs_chars)
    return clip("\n".join(parts), obs_chars - len(status) - 1) + "\n" + status


class PythonToolEnv:
    """One python_tool episode; state lives in typed attributes."""

    def __init__(
        self,
        problem: Problem,
        *,
        max_turns: int,
        system: bool,
        obs_chars: int,
        wall_s: float,
        memory_mb: int,
        allow_root: bool = False,
    ) -> None:
        self.problem = problem
        self.max_turns = max_turns
        self.system = system
        self.obs_chars = obs_chars
        self.wall_s = wall_s
        self.memory_mb = memory_mb
        self.allow_root = allow_root
        self.turns = 0
        self.runs = 0
        self.wasted = 0
        self.answer: str | None = None
        self.done = False
        self.sandbox = ""
        """Isolation level of the last sandbox run (``Isolation.level``), or ""."""

    def first_messages(self) -> list[Message]:
        """The problem, after the system message if enabled."""
        return opening(self.problem.text, SYSTEM_PROMPT if self.system else None)

    def first_observation(self) -> Observation:
        """What ``reset`` returns: the problem text, or system and user messages."""
        return as_observation(self.first_messages())

    async def reset(self, seed: int) -> Observation:
        """Start the episode; the problem is fixed, ``seed`` is unused."""
        self.turns = self.runs = self.wasted = 0
        self.answer = None
        self.done = False
        return self.first_observation()

    async def step(self, action: str) -> StepResult:
        """Apply one reply: run code in the sandbox, or take the answer."""
        if self.done:
            return StepResult(None, done=True, info={"error": "episode is over"})
        self.turns += 1
        obs = await self._respond(action)
        if self.answer is not None or self.turns >= self.max_turns:
            self.done = True
            obs = None
        info: dict[str, int | str] = {
            "runs": self.runs,
            "turns": self.turns,
            "wasted": self.wasted,
            "sandbox": self.sandbox,
        }
        return StepResult(obs, done=self.done, info=info)

    async def _respond(self, action: str) -> str | None:
        parsed = parse_action(action)
        if parsed is None:
            return self._waste(FORMAT_HINT)
        kind, arg = parsed
        if kind == "answer":
            if not normalize(arg):
                return self._waste("empty answer; format: answer 3")
            self.answer = arg
            return None
        if not arg.strip():
            return self._waste("empty program; format: run print(1+2)")
        self.runs += 1
        try:
            result = await run_python(
                arg,
                wall_s=self.wall_s,
                cpu_s=max(1, round(self.wall_s)),
                memory_mb=self.memory_mb,
                allow_root=self.allow_root,
            )
        except (OSError, ValueError) as err:  # the sandbox itself failed, not the program
            return f"(sandbox error: {err})"
        self.sandbox = result.isolation.level
        return tool_observation(result, self.obs_chars)

    def _waste(self, hint: str) -> str:
        self.wasted += 1
        return hint

    def score(self) -> float:
        """1.0 iff the episode's answer matches the expected one (normalised)."""
        if self.answer is None:
            return 0.0
        return 1.0 if normalize(self.answer) == normalize(self.problem.answer) else 0.0

    def state_dict(self) -> dict[str, object]:
        """The episode so far (``RestorableEnv``): counters, answer, done and
        the last sandbox level. Every ``run`` starts a fresh interpreter, so
        no program state outlives its step and none needs saving."""
        return {
            "problem": self.problem.text,
            "turns": self.turns,
            "runs": self.runs,
            "wasted": self.wasted,
            "answer": self.answer,
            "done": self.done,
            "sandbox": self.sandbox,
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Continue the episode :meth:`state_dict` recorded (same problem only)."""
        expect_same(state, "problem", self.problem.text)
        self.turns = read(state, "turns", int)
        self.runs = read(state, "runs", int)
        self.wasted = read(state, "wasted", int)
        self.answer = read_optional(state, "answer", str)
        self.done = read(state, "done", bool)
        self.sandbox = read(state, "sandbox", str)


class PythonToolTask:
    """Exact-answer arithmetic and string problems solved with a Python tool.

    Options: ``kinds`` (a subset of :data:`KINDS`), ``max_turns`` replies per
    episode, ``obs_chars`` characters of tool output shown, the sandbox's
    ``wall_s``, ``memory_mb`` and ``allow_root`` (see
    :func:`sao.envs.sandbox.run_python`), ``system`` for a system message describing
    the format, ``error_rate`` the share of demonstrations with a deliberate
    mistake (buggy program, guess, miscopied answer) or a crash-and-retry.
    """

    name = "python_tool"

    def __init__(
        self,
        *,
        seed: int = 0,
        kinds: tuple[str, ...] = tuple(KINDS),
        max_turns: int = 4,
        obs_chars: int = 200,
        wall_s: float = 5.0,
        memory_mb: int = 256,
        allow_root: bool = False,
        eval_size: int = 200,
        error_rate: float = 0.3,
        system: bool = False,
    ) -> None:
        unknown = [k for k in kinds if k not in KINDS]
        _check(bool(kinds) and not unknown, "kinds", f"use a non-empty subset of {list(KINDS)}")
        _check(max_turns >= 2, "max_turns", "use 2 or more (one run, one answer)")
        _check(obs_chars >= 16, "obs_chars", "use 16 or more")
        _check(wall_s > 0, "wall_s", "use a positive number of seconds")
        _check(eval_size >= 1, "eval_size", "use 1 or more")
        _check(0.0 <= error_rate <= 1.0, "error_rate", "use a value in [0, 1]")
        self.seed = seed
        self.kinds = tuple(kinds)
        self.max_turns, self.obs_chars = max_turns, obs_chars
        self.wall_s, self.memory_mb, self.allow_root = wall_s, memory_mb, allow_root
        self._eval_size = eval_size
        self.error_rate = error_rate
        self.system = system

    @property
    def eval_size(self) -> int:
        """Number of held-out problems."""
        return self._eval_size

    def split_of(self, text: str) -> Split:
        """The split a problem text belongs to (a pure function of the text)."""
        return split_of(self.seed, text, EVAL_SHARE)

    def problem(self, split: Split, index: int) -> Problem:
        """Problem ``index`` of ``split``: the first hashed candidate of that split."""
        return draw_problem(
            self.seed,
            split,
            index,
            lambda rng: KINDS[rng.choice(self.kinds)](rng),
            lambda p: p.text,
            EVAL_SHARE,
        )

    def make_env(self, split: Split, index: int) -> PythonToolEnv:
        """A fresh environment for problem ``index`` of ``split``."""
        return PythonToolEnv(
            self.problem(split, index),
            max_turns=self.max_turns,
            system=self.system,
            obs_chars=self.obs_chars,
            wall_s=self.wall_s,
            memory_mb=self.memory_mb,
            allow_root=self.allow_root,
        )

    def demonstrations(self, n: int, *, seed: int) -> list[Conversation]:
        """``n`` train-split solutions; ``error_rate`` of them are flawed
        (buggy program, unchecked guess, miscopied answer, crash then retry)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = random.Random(stable_hash(self.seed, "demos", seed))
        return [self._demo(rng) for _ in range(n)]

    def _demo(self, rng: random.Random) -> Conversation:
        env = self.make_env("train", rng.randrange(10**9))
        transcript = Transcript(env.first_messages())
        for action, obs in _demo_turns(env.problem, rng, self.error_rate):
            transcript.record(action, None if obs is None else clip(obs, self.obs_chars))
        return transcript.conversation()


def _demo_turns(p: Problem, rng: random.Random, error_rate: float) -> list[tuple[str, str | None]]:
    """(action, observation) pairs for one demonstration; observations are the
    outputs the sandbox gives for these programs."""
    good = [(f"run {p.code}", p.answer), (f"answer {p.answer}", None)]
    if rng.random() >= error_rate:
        return good
    flaw = rng.choice(("bug", "guess", "miscopy", "crash"))
    if flaw == "bug":
        return [(f"run {p.buggy_code}", p.buggy_output), (f"answer {p.buggy_output}", None)]
    if flaw == "guess":
        return [(f"answer {_miscopy(p.answer, rng)}", None)]
    if flaw == "miscopy":
        return [good[0], (f"answer {_miscopy(p.answer, rng)}", None)]
    return [("run print(x)", "NameError: name 'x' is not defined"), *good]


def _miscopy(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer: an integer off by one, or two letters swapped."""
    if answer.lstrip("-").isdigit():
        return str(int(answer) + rng.choice((-1, 1)))
    if len(set(answer)) < 2:
        return answer + answer[-1:]
    while True:
        i, j = sorted(rng.sample(range(len(answer)), 2))
        swapped = answer[:i] + answer[j] + answer[i + 1 : j] + answer[i] + answer[j + 1 :]
        if swapped != answer:
            return swapped


def _check(ok: bool, option: str, fix: str) -> None:
    """Raise a ``ValueError`` naming ``option`` when ``ok`` is false."""
    if not ok:
        raise ValueError(f"PythonToolTask option {option}: {fix}")
