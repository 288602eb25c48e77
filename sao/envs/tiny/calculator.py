"""``calculator``: multi-step integer arithmetic solved with a calculator tool.

The policy calls the tool one operation at a time, copies results forward and
answers. Environment feedback is sent with role ``user``. An episode::

    user:      solve 12*3+7-5
    assistant: calc 12*3
    user:      =36
    assistant: calc 36+7
    user:      =43
    assistant: calc 43-5
    user:      =38
    assistant: answer 38

Score 1.0 iff the answer equals the problem's value (standard precedence,
``//`` is floor division). A malformed line, a call with too many operators,
a call past ``max_calls`` or (with ``require_call``) an answer before any call
gets a short hint observation and wastes a turn; the episode ends at the first
answer or after ``max_turns`` actions. When an action spans several lines only
its last non-empty line is read.

Train/eval disjointness: a problem's split is a pure function of its text:
text ``t`` is held out iff ``blake2b(seed, t) % EVAL_SHARE == 0``.
``make_env(split, i)`` draws candidates from ``blake2b(seed, split, i,
attempt)`` and keeps the first whose text belongs to ``split``, so no eval
problem text can ever appear in the train split.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass

from sao.envs._split import draw_problem, split_of, stable_hash
from sao.envs._state import expect_same, read, read_optional
from sao.envs._tools import as_observation, last_line, opening, replay
from sao.envs.base import Conversation, Observation, Split, StepResult

__all__ = ["EVAL_SHARE", "CalcError", "CalculatorEnv", "CalculatorTask", "evaluate", "solve_steps"]

EVAL_SHARE = 10
"""One problem text in ``EVAL_SHARE`` belongs to the eval split."""

SYSTEM_PROMPT = (
    "Solve the arithmetic problem with a calculator. "
    "Call it one operation at a time as 'calc 12*3'; it replies '=36'. "
    "Finish with 'answer N'."
)
FORMAT_HINT = "format: calc 3*4 or answer 12"
_MAX_EXPR_CHARS = 64
_MAX_DIGITS = 9
_MAX_ABS = 10**18
_LINE = re.compile(r"^(calc|answer)\s*:?\s*(.*)$", re.IGNORECASE | re.DOTALL)
_INT = re.compile(r"^-?\d{1,18}$")
_TOKEN = re.compile(r"\s*(\d+|//|[-+*()])")


class CalcError(ValueError):
    """An expression the calculator tool rejects; the message is shown to the policy."""


class _Parser:
    """Recursive-descent parser for ``+ - * //``, unary minus and parentheses."""

    def __init__(self, text: str) -> None:
        self.tokens = self._tokenize(text)
        self.pos = 0
        self.ops = 0

    @staticmethod
    def _tokenize(text: str) -> list[str]:
        tokens: list[str] = []
        pos = 0
        stripped = text.rstrip()
        while pos < len(stripped):
            m = _TOKEN.match(stripped, pos)
            if m is None:
                raise CalcError(f"error: bad character {stripped[pos]!r}")
            tokens.append(m.group(1))
            pos = m.end()
        return tokens

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def parse(self) -> int:
        if not self.tokens:
            raise CalcError("error: empty expression")
        value = self._expr()
        if self._peek() is not None:
            raise CalcError(f"error: unexpected {self._peek()!r}")
        return value

    def _expr(self) -> int:
        value = self._term()
        while self._peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            self.ops += 1
            rhs = self._term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def _term(self) -> int:
        value = self._factor()
        while self._peek() in ("*", "//"):
            op = self.tokens[self.pos]
            self.pos += 1
            self.ops += 1
            rhs = self._factor()
            if op == "*":
                value *= rhs
            elif rhs == 0:
                raise CalcError("error: division by zero")
            else:
                value //= rhs
            if abs(value) > _MAX_ABS:
                raise CalcError("error: result too large")
        return value

    def _factor(self) -> int:
        tok = self._peek()
        if tok is None:
            raise CalcError("error: expression ends early")
        self.pos += 1
        if tok == "-":
            return -self._factor()
        if tok == "(":
            value = self._expr()
            if self._peek() != ")":
                raise CalcError("error: missing )")
            self.pos += 1
            return value
        if tok.isdigit():
            if len(tok) > _MAX_DIGITS:
                raise CalcError("error: number too long")
            return int(tok)
        raise CalcError(f"error: unexpected {tok!r}")


def evaluate(expr: str, *, max_ops: int | None = None) -> int:
    """Evaluate an integer expression (``+ - * //``, unary minus, parentheses).

    Raises :class:`CalcError` for malformed input, division by zero, oversized
    numbers or more than ``max_ops`` binary operators. Never calls ``eval``.
    """
    if len(expr) > _MAX_EXPR_CHARS:
        raise CalcError("error: expression too long")
    parser = _Parser(expr)
    value = parser.parse()
    if max_ops is not None and parser.ops > max_ops:
        raise CalcError(f"error: at most {max_ops} operation(s) per call")
    return value


def solve_steps(problem: str) -> list[tuple[str, int]]:
    """The calls that solve a generated ``problem`` one operation at a time.

    Reduces the leftmost ``*``/``//`` first, then the leftmost ``+``/``-``;
    returns ``[(call expression, result), ...]``.
    """
    parts = re.findall(r"\d+|//|[-+*]", problem)
    nums = [int(p) for p in parts[::2]]
    ops = parts[1::2]
    steps: list[tuple[str, int]] = []
    while ops:
        i = _next_op(ops)
        expr = f"{nums[i]}{ops[i]}{nums[i + 1]}"
        value = evaluate(expr)
        steps.append((expr, value))
        nums[i : i + 2] = [value]
        del ops[i]
    return steps


def _next_op(ops: list[str]) -> int:
    """Index of the operator reduced next: the leftmost ``*``/``//``, else the leftmost."""
    return next((i for i, op in enumerate(ops) if op in ("*", "//")), 0)


@dataclass(frozen=True)
class _Problem:
    text: str
    target: int


class CalculatorEnv:
    """One calculator episode; state lives in typed attributes (see module docstring)."""

    def __init__(
        self,
        problem: str,
        target: int,
        *,
        max_calls: int,
        max_turns: int,
        ops_per_call: int,
        require_call: bool,
        system: bool,
    ) -> None:
        self.problem = problem
        self.target = target
        self.max_calls = max_calls
        self.max_turns = max_turns
        self.ops_per_call = ops_per_call
        self.require_call = require_call
        self.system = system
        self.calls = 0
        self.turns = 0
        self.wasted = 0
        self.answer: int | None = None
        self.done = False

    @property
    def prompt(self) -> str:
        """The first user message."""
        return f"solve {self.problem}"

    def first_observation(self) -> Observation:
        """What ``reset`` returns: the prompt, after the system message if enabled."""
        return as_observation(opening(self.prompt, SYSTEM_PROMPT if self.system else None))

    async def reset(self, seed: int) -> Observation:
        """Start the episode; the problem is fixed, ``seed`` is unused."""
        self.calls = self.turns = self.wasted = 0
        self.answer = None
        self.done = False
        return self.first_observation()

    async def step(self, action: str) -> StepResult:
        """Apply one action (``calc EXPR`` or ``answer N``)."""
        return self.act(action)

    def act(self, action: str) -> StepResult:
        """Synchronous core of :meth:`step` (also used to build demonstrations)."""
        if self.done:
            return StepResult(None, done=True, info={"error": "episode is over"})
        self.turns += 1
        obs, wasted = self._respond(action)
        self.wasted += wasted
        if self.answer is not None or self.turns >= self.max_turns:
            self.done = True
            obs = None
        info = {"calls": self.calls, "turns": self.turns, "wasted": self.wasted}
        return StepResult(obs, done=self.done, info=info)

    def _respond(self, action: str) -> tuple[str | None, bool]:
        """The observation for ``action`` and whether the turn was wasted."""
        m = _LINE.match(last_line(action))
        if m is None:
            return FORMAT_HINT, True
        kind, arg = m.group(1).lower(), m.group(2).strip()
        if kind == "answer":
            if not _INT.match(arg):
                return FORMAT_HINT, True
            if self.require_call and self.calls == 0:
                return "use calc first, e.g. calc 3*4", True
            self.answer = int(arg)
            return None, False
        if self.calls >= self.max_calls:
            return "no calls left; answer N", True
        try:
            value = evaluate(arg, max_ops=self.ops_per_call)
        except CalcError as err:
            return str(err), True
        self.calls += 1
        return f"={value}", False

    def score(self) -> float:
        """1.0 iff the episode's answer equals the problem's value."""
        return 1.0 if self.answer is not None and self.answer == self.target else 0.0

    def state_dict(self) -> dict[str, object]:
        """The episode so far (``RestorableEnv``): counters, answer, done."""
        return {
            "problem": self.problem,
            "calls": self.calls,
            "turns": self.turns,
            "wasted": self.wasted,
            "answer": self.answer,
            "done": self.done,
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Continue the episode :meth:`state_dict` recorded (same problem only)."""
        expect_same(state, "problem", self.problem)
        self.calls = read(state, "calls", int)
        self.turns = read(state, "turns", int)
        self.wasted = read(state, "wasted", int)
        self.answer = read_optional(state, "answer", int)
        self.done = read(state, "done", bool)


class CalculatorTask:
    """Multi-step arithmetic over small integers, solved with a calculator tool.

    Options: ``min_ops``/``max_ops`` operations per problem, operands in
    ``[1, max_operand]``, ``allow_floordiv`` adds ``//``; the tool accepts at
    most ``ops_per_call`` operators per call and ``max_calls`` calls; an
    episode lasts at most ``max_turns`` actions. ``error_rate`` is the share of
    demonstrations with a deliberate mistake or detour. ``early_answer_rate``
    is the share of demonstrations with a systematic bad habit: answering with
    the first call's result instead of finishing the computation (correct only
    for one-operation problems), the kind of habit a warm-started policy
    carries and RL must unlearn. ``system`` prepends a system
    message describing the tool. Demonstrations call the whole problem at once
    when it has at most ``ops_per_call`` operations, else one operation at a time.
    """

    name = "calculator"

    def __init__(
        self,
        *,
        seed: int = 0,
        min_ops: int = 2,
        max_ops: int = 3,
        max_operand: int = 20,
        allow_floordiv: bool = False,
        ops_per_call: int = 1,
        max_calls: int = 4,
        max_turns: int = 6,
        require_call: bool = True,
        eval_size: int = 200,
        error_rate: float = 0.3,
        early_answer_rate: float = 0.0,
        system: bool = False,
    ) -> None:
        _check(1 <= min_ops <= max_ops <= 6, "min_ops/max_ops", "need 1 <= min_ops <= max_ops <= 6")
        _check(2 <= max_operand <= 999, "max_operand", "use a value in [2, 999]")
        _check(ops_per_call >= 1, "ops_per_call", "use 1 or more")
        _check(max_calls >= 1, "max_calls", "use 1 or more")
        _check(
            max_calls * ops_per_call >= max_ops,
            "max_calls",
            f"max_calls * ops_per_call must be >= max_ops ({max_ops}) so problems are solvable",
        )
        _check(max_turns > max_calls, "max_turns", "must exceed max_calls (one turn to answer)")
        _check(eval_size >= 1, "eval_size", "use 1 or more")
        _check(0.0 <= error_rate <= 1.0, "error_rate", "use a value in [0, 1]")
        _check(0.0 <= early_answer_rate <= 1.0, "early_answer_rate", "use a value in [0, 1]")
        self.seed = seed
        self.min_ops, self.max_ops, self.max_operand = min_ops, max_ops, max_operand
        self.ops = ("+", "-", "*", "//") if allow_floordiv else ("+", "-", "*")
        self.ops_per_call, self.max_calls, self.max_turns = ops_per_call, max_calls, max_turns
        self.require_call = require_call
        self._eval_size = eval_size
        self.error_rate = error_rate
        self.early_answer_rate = early_answer_rate
        self.system = system

    @property
    def eval_size(self) -> int:
        """Number of held-out problems."""
        return self._eval_size

    def split_of(self, text: str) -> Split:
        """The split a problem text belongs to (a pure function of the text)."""
        return split_of(self.seed, text, EVAL_SHARE)

    def problem(self, split: Split, index: int) -> _Problem:
        """Problem ``index`` of ``split``: the first hashed candidate of that split."""
        text = draw_problem(self.seed, split, index, self._draw, lambda t: t, EVAL_SHARE)
        return _Problem(text, evaluate(text))

    def _draw(self, rng: random.Random) -> str:
        n_ops = rng.randint(self.min_ops, self.max_ops)
        nums = [rng.randint(1, self.max_operand) for _ in range(n_ops + 1)]
        ops = [rng.choice(self.ops) for _ in range(n_ops)]
        return str(nums[0]) + "".join(f"{o}{n}" for o, n in zip(ops, nums[1:], strict=True))

    def make_env(self, split: Split, index: int) -> CalculatorEnv:
        """A fresh environment for problem ``index`` of ``split``."""
        p = self.problem(split, index)
        return CalculatorEnv(
            p.text,
            p.target,
            max_calls=self.max_calls,
            max_turns=self.max_turns,
            ops_per_call=self.ops_per_call,
            require_call=self.require_call,
            system=self.system,
        )

    def demonstrations(self, n: int, *, seed: int) -> list[Conversation]:
        """``n`` train-split solutions; ``error_rate`` of them contain a slip
        (typo, wrong precedence, early guess, off-by-one answer) or a redundant call."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = random.Random(stable_hash(self.seed, "demos", seed))
        return [self._demo(rng) for _ in range(n)]

    def _demo(self, rng: random.Random) -> Conversation:
        env = self.make_env("train", rng.randrange(10**9))
        one_call = len(re.findall(r"//|[-+*]", env.problem)) <= self.ops_per_call
        if rng.random() < self.early_answer_rate:
            (expr, value), *_ = solve_steps(env.problem)
            actions = [f"calc {expr}", f"answer {value}"]
        else:
            actions = _demo_actions(env.problem, rng, self.error_rate, one_call=one_call)
        return replay(opening(env.prompt, SYSTEM_PROMPT if self.system else None), actions, env.act)


def _demo_actions(
    problem: str, rng: random.Random, error_rate: float, *, one_call: bool = False
) -> list[str]:
    """Scripted actions for one demonstration, with a deliberate flaw at
    ``error_rate``. ``one_call``: the whole problem in a single call."""
    steps = [(problem, evaluate(problem))] if one_call else solve_steps(problem)
    calls = [f"calc {e}" for e, _ in steps]
    answer = steps[-1][1]
    if rng.random() >= error_rate:
        return [*calls, f"answer {answer}"]
    flaw = rng.choice(("typo", "order", "early", "off", "redundant"))
    if flaw == "typo" or (one_call and flaw in ("order", "early")):
        # Miscopy an operand of the first call and carry the wrong value forward.
        parts = re.findall(r"\d+|//|[-+*]", problem)
        i = 2 * _next_op(parts[1::2]) + 2
        parts[i] = str(int(parts[i]) + rng.choice((1, 2, 10)))
        bad = "".join(parts)
        if one_call:
            return [f"calc {bad}", f"answer {evaluate(bad)}"]
        bad_steps = solve_steps(bad)
        return [f"calc {e}" for e, _ in bad_steps] + [f"answer {bad_steps[-1][1]}"]
    if flaw == "order":
        # Ignore precedence: evaluate strictly left to right.
        parts = re.findall(r"\d+|//|[-+*]", problem)
        acc, out = int(parts[0]), []
        for op, num in zip(parts[1::2], parts[2::2], strict=True):
            expr = f"{acc}{op}{num}"
            acc = evaluate(expr)
            out.append(f"calc {expr}")
        return [*out, f"answer {acc}"]
    if flaw == "early":
        return [calls[0], f"answer {steps[0][1]}"]
    if flaw == "off":
        return [*calls, f"answer {answer + rng.choice((-1, 1))}"]
    return [calls[0], *calls, f"answer {answer}"]


def _check(ok: bool, option: str, fix: str) -> None:
    """Raise a ``ValueError`` naming ``option`` when ``ok`` is false."""
    if not ok:
        raise ValueError(f"CalculatorTask option {option}: {fix}")
