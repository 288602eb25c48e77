"""``guess_number``: find a hidden integer with higher/lower feedback.

Environment feedback is sent with role ``user``. An episode (N = 32, hidden
number 21)::

    user:      guess a number in 1-32, 6 tries
    assistant: guess 16
    user:      higher
    assistant: guess 24
    user:      lower
    assistant: guess 20
    user:      higher
    assistant: guess 22
    user:      lower
    assistant: guess 21

Score 1.0 iff the number is found within ``max_turns`` actions (default
``ceil(log2 N) + 1``, exactly enough for binary search). A malformed line gets
``reply 'guess N', N a number in 1-32`` and an out-of-range guess
``out of range 1-32``; both waste a turn. The hint names no number: a hint
``format: guess 16`` was copied verbatim by a pretrained model on every later
turn. When an action spans several lines only its last non-empty line is read.

``shots`` > 0 puts that many whole games before the prompt as earlier chat
turns, each played by exact binary search to its hidden number, so a
pretrained chat model sees the game instead of reading about it. The hidden
numbers alternate between the upper and the lower half of the range and take
at least 3 guesses (drawn by ``shots_seed``; the same for every run seed by
default): games that only ever went lower were copied whatever the feedback.

Each step reports how the policy uses the feedback: ``metric/guess/in_interval``
is the share of guesses after the first that lie inside the interval the
earlier feedback allows (a repeated or excluded guess is outside);
``metric/guess/turns`` counts the actions and ``metric/guess/wasted`` the
malformed or out-of-range ones.

Splits: the prompt never reveals the number, so there is no problem text to
leak; the splits are separate hash streams. Train problem ``i`` hides
``1 + blake2b(seed, "train", i) % N``; eval problems walk seeded
permutations of ``[1, N]``, so every number is held out equally often.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping

from sao.envs._split import stable_hash
from sao.envs._state import expect_same, read, read_list
from sao.envs._tools import Transcript, as_observation, last_line, opening
from sao.envs.base import Conversation, Observation, Split, StepResult
from sao.types import Message

__all__ = ["GuessNumberEnv", "GuessNumberTask"]

SYSTEM_PROMPT = (
    "A number is hidden. Reply 'guess N'; you will be told 'higher' or 'lower'. "
    "Find it within the given tries."
)
_LINE = re.compile(r"^guess\s*:?\s*(-?\d{1,12})\s*\.?$", re.IGNORECASE)


class GuessNumberEnv:
    """One guessing episode; state lives in typed attributes (see module docstring)."""

    def __init__(
        self,
        target: int,
        *,
        n: int,
        max_turns: int,
        system: bool,
        shots: tuple[Message, ...] = (),
    ) -> None:
        self.target = target
        self.n = n
        self.max_turns = max_turns
        self.system = system
        self.shots = shots
        self.turns = 0
        self.wasted = 0
        self.guesses: list[int] = []
        self.found = False
        self.done = False

    @property
    def prompt(self) -> str:
        """The first user message."""
        return f"guess a number in 1-{self.n}, {self.max_turns} tries"

    @property
    def format_hint(self) -> str:
        """The reply to a malformed action."""
        return f"reply 'guess N', N a number in 1-{self.n}"

    def first_observation(self) -> Observation:
        """What ``reset`` returns: the prompt, after the system message if enabled
        and the shots."""
        first = opening(self.prompt, SYSTEM_PROMPT if self.system else None)
        return as_observation([*first[:-1], *self.shots, first[-1]])

    async def reset(self, seed: int) -> Observation:
        """Start the episode; the hidden number is fixed, ``seed`` is unused."""
        self.turns = self.wasted = 0
        self.guesses = []
        self.found = self.done = False
        return self.first_observation()

    async def step(self, action: str) -> StepResult:
        """Apply one action (``guess N``)."""
        return self.act(action)

    def act(self, action: str) -> StepResult:
        """Synchronous core of :meth:`step` (also used to build demonstrations)."""
        if self.done:
            return StepResult(None, done=True, info={"error": "episode is over"})
        self.turns += 1
        obs = self._respond(action)
        if self.found or self.turns >= self.max_turns:
            self.done = True
            obs = None
        info = {
            "turns": self.turns,
            "wasted": self.wasted,
            "found": int(self.found),
            "metric/guess/turns": float(self.turns),
            "metric/guess/wasted": float(self.wasted),
        }
        inside = self.in_interval()
        if inside is not None:
            info["metric/guess/in_interval"] = inside
        return StepResult(obs, done=self.done, info=info)

    def in_interval(self) -> float | None:
        """The share of guesses after the first that lie inside the interval the
        feedback to the earlier ones allows (None before a second guess)."""
        lo, hi, inside = 1, self.n, []
        for i, guess in enumerate(self.guesses):
            if i:
                inside.append(lo <= guess <= hi)
            if guess < self.target:
                lo = max(lo, guess + 1)
            elif guess > self.target:
                hi = min(hi, guess - 1)
        return sum(inside) / len(inside) if inside else None

    def _respond(self, action: str) -> str | None:
        m = _LINE.match(last_line(action))
        if m is None:
            self.wasted += 1
            return self.format_hint
        guess = int(m.group(1))
        if not 1 <= guess <= self.n:
            self.wasted += 1
            return f"out of range 1-{self.n}"
        self.guesses.append(guess)
        if guess == self.target:
            self.found = True
            return None
        return "higher" if guess < self.target else "lower"

    def score(self) -> float:
        """1.0 iff the hidden number was guessed within the turn budget."""
        return 1.0 if self.found else 0.0

    def state_dict(self) -> dict[str, object]:
        """The episode so far (``RestorableEnv``): counters, guesses, outcome."""
        return {
            "target": self.target,
            "n": self.n,
            "turns": self.turns,
            "wasted": self.wasted,
            "guesses": list(self.guesses),
            "found": self.found,
            "done": self.done,
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Continue the episode :meth:`state_dict` recorded (same problem only)."""
        expect_same(state, "target", self.target)
        expect_same(state, "n", self.n)
        self.turns = read(state, "turns", int)
        self.wasted = read(state, "wasted", int)
        self.guesses = read_list(state, "guesses", int)
        self.found = read(state, "found", bool)
        self.done = read(state, "done", bool)


class GuessNumberTask:
    """Binary search for a hidden integer in ``[1, n]`` (a long-horizon credit task).

    ``max_turns`` defaults to ``ceil(log2 n) + 1``. ``error_rate`` is the
    per-guess probability that a demonstration guess is off-centre or
    redundant (already excluded). ``system`` prepends a system message.
    ``shots`` games played by binary search on train problems of
    ``shots_seed`` (default: 0, the same for every run seed) come before the
    prompt (see the module docstring).
    """

    name = "guess_number"

    def __init__(
        self,
        *,
        seed: int = 0,
        n: int = 32,
        max_turns: int | None = None,
        eval_size: int = 200,
        error_rate: float = 0.2,
        system: bool = False,
        shots: int = 0,
        shots_seed: int = 0,
    ) -> None:
        if not 2 <= n <= 10**6:
            raise ValueError(f"GuessNumberTask option n: use a value in [2, 1e6], got {n}")
        turns = math.ceil(math.log2(n)) + 1 if max_turns is None else max_turns
        if turns < 1:
            raise ValueError(f"GuessNumberTask option max_turns: use 1 or more, got {turns}")
        if eval_size < 1:
            raise ValueError(f"GuessNumberTask option eval_size: use 1 or more, got {eval_size}")
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"GuessNumberTask option error_rate: use [0, 1], got {error_rate}")
        if not 0 <= shots <= 16:
            raise ValueError(f"GuessNumberTask option shots: use 0 to 16, got {shots}")
        self.seed = seed
        self.n = n
        self.max_turns = turns
        self._eval_size = eval_size
        self.error_rate = error_rate
        self.system = system
        self.shots = self._shots(shots, shots_seed)

    def _shots(self, count: int, shots_seed: int) -> tuple[Message, ...]:
        """``count`` exact binary searches, one game after another, as chat turns.
        Their hidden numbers alternate between the upper and the lower half of the
        range (drawn by ``shots_seed``) and take at least 3 guesses, so the games
        show both answers followed: shots that only ever went lower were copied
        (8, 4, 2 whatever the feedback)."""
        rng = random.Random(stable_hash(shots_seed, "shots"))
        half = self.n // 2
        messages: list[Message] = []
        for k in range(count):
            pool = range(half + 1, self.n + 1) if k % 2 == 0 else range(1, half + 1)
            games = [self._binary_search(t) for t in pool]
            long = [g for g in games if len(g) >= 5] or games  # 3 guesses: prompt + 5
            messages += rng.choice(long)
        return tuple(messages)

    def _binary_search(self, target: int) -> tuple[Message, ...]:
        """The game for ``target`` played by exact binary search."""
        env = GuessNumberEnv(target, n=self.n, max_turns=self.max_turns, system=False)
        transcript = Transcript([Message("user", env.prompt)])
        lo, hi = 1, self.n
        while not env.done:
            guess = (lo + hi) // 2
            result = transcript.play(env.act, f"guess {guess}")
            lo, hi = (guess + 1, hi) if result.observation == "higher" else (lo, guess - 1)
        return transcript.conversation()

    @property
    def eval_size(self) -> int:
        """Number of held-out problems."""
        return self._eval_size

    def target(self, split: Split, index: int) -> int:
        """The hidden number of problem ``index`` of ``split``."""
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        if split == "train":
            return 1 + stable_hash(self.seed, "train", index) % self.n
        if split == "eval":
            block, pos = divmod(index, self.n)
            perm = list(range(1, self.n + 1))
            random.Random(stable_hash(self.seed, "eval", block)).shuffle(perm)
            return perm[pos]
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")

    def make_env(self, split: Split, index: int) -> GuessNumberEnv:
        """A fresh environment for problem ``index`` of ``split``."""
        return GuessNumberEnv(
            self.target(split, index),
            n=self.n,
            max_turns=self.max_turns,
            system=self.system,
            shots=self.shots,
        )

    def demonstrations(self, n: int, *, seed: int) -> list[Conversation]:
        """``n`` noisy binary searches on train problems (some fail by running out of tries)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = random.Random(stable_hash(self.seed, "demos", seed))
        return [self._demo(rng) for _ in range(n)]

    def _demo(self, rng: random.Random) -> Conversation:
        env = self.make_env("train", rng.randrange(10**9))
        transcript = Transcript(opening(env.prompt, SYSTEM_PROMPT if self.system else None))
        lo, hi = 1, self.n
        while not env.done:
            guess = _noisy_guess(lo, hi, self.n, rng, self.error_rate)
            result = transcript.play(env.act, f"guess {guess}")
            if result.observation == "higher":
                lo = max(lo, guess + 1)
            elif result.observation == "lower":
                hi = min(hi, guess - 1)
        return transcript.conversation()


def _noisy_guess(lo: int, hi: int, n: int, rng: random.Random, error_rate: float) -> int:
    """The binary-search midpoint of ``[lo, hi]``, or at ``error_rate`` an
    off-centre guess inside the interval or a redundant one outside it."""
    if rng.random() >= error_rate:
        return (lo + hi) // 2
    outside = [g for g in (lo - 1, hi + 1) if 1 <= g <= n]
    if outside and rng.random() < 0.3:
        return rng.choice(outside)
    return rng.randint(lo, hi)
