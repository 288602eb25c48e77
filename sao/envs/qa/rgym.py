"""``reasoning_gym``: any reasoning-gym dataset as a single-turn task.

The prompt is the entry's question plus a short instruction; the reply's
final answer (:func:`sao.envs.qa.answers.extract_answer`: what follows the last
``answer`` line, else a ``\\boxed{}`` or ``<answer>`` tag) is scored by the
dataset's own ``score_answer(answer, entry)`` (``scorer="dataset"``, which
gives partial credit to an answer that contains the reference: ``13`` for
``3`` scores 0.5), or by math-verify against ``entry['answer']``
(``scorer="math"``: 1 for the same value, else 0; an expression for a number
scores 0, see :func:`sao.envs.qa.answers.math_score`). ``shots`` > 0 puts that
many fixed train entries before the question as earlier chat turns, each
answered by ``shot_reply`` filled from the entry (``{answer}`` and the fields
of its ``metadata``, e.g. ``{expression} = {answer}\nanswer {answer}``): few-shot
in the chat template, so a pretrained model sees the format instead of
reading about it. The shots are the first train entries of the run's seed,
or with ``shots_seed`` the first distinct questions that seed's train split
draws: then every seed sees the same shots (the eval split skips their
questions). A small model's start depends on them: SmolLM2's held-out
success was 0.28 with seed 0's shots and 0.15 with seed 11's, which held a
negative answer. A reply without a marker
scores 0 and reports ``metric/format/missing_answer``; ``require_marker=False``
scores the whole reply instead (open to echoing the question's computation,
see :mod:`sao.envs.qa.answers`). An episode::

    user:      Calculate 5 - 3 - 6.
               Finish with 'answer X'.
    assistant: answer -4

A scorer that raises gives reward 0 with its reason in the step's ``info``.
The train split is ``create_dataset(dataset, seed=train_seed)`` and the eval
split ``create_dataset(dataset, seed=eval_seed)``, both seeds derived from
``seed``; a train entry whose question also appears in the eval split is
skipped, so the splits never share a question.
"""

from __future__ import annotations

import difflib
import hashlib
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, Protocol

from sao.envs._state import expect_same, read, read_optional
from sao.envs.base import Conversation, Message, Observation, Split, StepResult
from sao.envs.qa.answers import MISSING_ANSWER, extract_answer, math_score
from sao.envs.qa.dataset import INSTRUCTION, answer_demo, safe_score, wrong_answer

__all__ = ["ReasoningGymEnv", "ReasoningGymTask", "dataset_names"]

_MAX_SKIPS = 1000
_SKIP_STRIDE = 7919


def _distinct(entries: Iterable[Entry], n: int) -> list[Entry]:
    """The first ``n`` of ``entries`` with distinct questions (option ``shots``)."""
    shots: dict[str, Entry] = {}
    for entry in entries:
        if len(shots) == n:
            break
        shots.setdefault(str(entry["question"]), entry)
    _check(len(shots) == n, "shots", f"the train split has fewer than {n} distinct questions")
    return list(shots.values())


def _hash(*parts: object) -> int:
    data = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


Entry = Mapping[str, object]
"""A reasoning-gym entry: ``question``, ``answer``, ``metadata``."""


class AnswerScorer(Protocol):
    """What the environment needs from a reasoning-gym dataset."""

    def score_answer(self, answer: str | None, entry: Entry) -> float: ...


class GymDataset(AnswerScorer, Protocol):
    """A reasoning-gym ``ProceduralDataset``: indexable entries plus a scorer."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Entry: ...


def dataset_names() -> list[str]:
    """Names of the datasets reasoning-gym registers."""
    from reasoning_gym.factory import DATASETS  # optional dependency, imported on use

    return sorted(DATASETS)


class ReasoningGymEnv:
    """One single-turn episode over a reasoning-gym entry."""

    def __init__(
        self,
        entry: Entry,
        dataset: AnswerScorer,
        *,
        instruction: str | None,
        system: str | None,
        require_marker: bool = True,
        scorer: Literal["dataset", "math"] = "dataset",
        shots: Sequence[tuple[Entry, str]] = (),
    ) -> None:
        self.entry = entry
        self.dataset = dataset
        self.instruction = instruction
        self.system = system
        self.require_marker = require_marker
        self.scorer = scorer
        self.shots = tuple(shots)
        self.reward = 0.0
        self.error: str | None = None
        self.done = False

    def _question(self, entry: Entry) -> Message:
        text = str(entry["question"]).strip()
        return Message("user", f"{text}\n{self.instruction}" if self.instruction else text)

    def first_messages(self) -> list[Message]:
        """The question with the instruction appended, after the system message if set
        and the shots (each a question and its reply)."""
        msgs = [Message("system", self.system)] if self.system else []
        for shot, reply in self.shots:
            msgs += [self._question(shot), Message("assistant", reply)]
        return [*msgs, self._question(self.entry)]

    def first_observation(self) -> Observation:
        """What ``reset`` returns: the question text, or all the messages."""
        msgs = self.first_messages()
        return tuple(msgs) if len(msgs) > 1 else msgs[0].content

    async def reset(self, seed: int) -> Observation:
        """Start the episode; the entry is fixed, ``seed`` is unused."""
        self.reward, self.error, self.done = 0.0, None, False
        return self.first_observation()

    async def step(self, action: str) -> StepResult:
        """Score the reply with the dataset's ``score_answer`` and end the episode."""
        if self.done:
            return StepResult(None, done=True, info={"error": "episode is over"})
        self.done = True
        answer = extract_answer(action, require_marker=self.require_marker)
        self.reward, self.error = 0.0, None
        if answer is not None and self.scorer == "math":
            reference = str(self.entry["answer"])
            self.reward, self.error = safe_score(lambda: math_score(action, reference))
        elif answer is not None:
            self.reward, self.error = safe_score(
                lambda: self.dataset.score_answer(answer=answer, entry=self.entry)
            )
        info: dict[str, float | int | str] = {
            "reward": self.reward,
            MISSING_ANSWER: float(extract_answer(action) is None),
        }
        if self.error is not None:
            info["error"] = self.error
        return StepResult(None, done=True, info=info)

    def score(self) -> float:
        """The reward computed at the reply (0.0 if there was none)."""
        return self.reward

    def state_dict(self) -> dict[str, object]:
        """The episode so far (``RestorableEnv``); entry and scorer are the task's."""
        return {
            "question": str(self.entry["question"]),
            "reward": self.reward,
            "error": self.error,
            "done": self.done,
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Continue the episode :meth:`state_dict` recorded (same entry only)."""
        expect_same(state, "question", str(self.entry["question"]))
        self.reward = read(state, "reward", float)
        self.error = read_optional(state, "error", str)
        self.done = read(state, "done", bool)


class ReasoningGymTask:
    """A reasoning-gym dataset by name (``dataset``), with ``config`` passed
    to ``create_dataset``; ``train_size`` entries before the train split wraps
    around, ``eval_size`` held-out entries; ``instruction`` appended to each
    question (None for none), an optional ``system`` message,
    ``error_rate`` the share of demonstrations with a wrong answer,
    ``require_marker`` (False: a reply without an answer marker is scored
    whole, see :mod:`sao.envs.qa.answers`), ``scorer``, ``shots`` and
    ``shot_reply`` (module docstring)."""

    name = "reasoning_gym"

    def __init__(
        self,
        dataset: str = "basic_arithmetic",
        *,
        config: Mapping[str, object] | None = None,
        seed: int = 0,
        train_size: int = 100_000,
        eval_size: int = 200,
        instruction: str | None = INSTRUCTION,
        system: str | None = None,
        error_rate: float = 0.3,
        require_marker: bool = True,
        scorer: Literal["dataset", "math"] = "dataset",
        shots: int = 0,
        shot_reply: str = "answer {answer}",
        shots_seed: int | None = None,
    ) -> None:
        _check(isinstance(require_marker, bool), "require_marker", "use true or false")
        _check(scorer in ("dataset", "math"), "scorer", f"use 'dataset' or 'math', not {scorer!r}")
        _check(isinstance(shots, int) and 0 <= shots <= 16, "shots", "use 0 to 16")
        _check(train_size >= 1, "train_size", "use 1 or more")
        _check(eval_size >= 1, "eval_size", "use 1 or more")
        _check(0.0 <= error_rate <= 1.0, "error_rate", "use a value in [0, 1]")
        names = dataset_names()
        if dataset not in names:
            close = difflib.get_close_matches(dataset, names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"ReasoningGymTask option dataset: unknown reasoning-gym dataset {dataset!r}."
                f"{hint} Valid names: {', '.join(names)}"
            )
        self.dataset = dataset
        self.config = dict(config or {})
        self.seed = seed
        _check(shots_seed is None or isinstance(shots_seed, int), "shots_seed", "use an integer")
        fixed = [] if shots_seed is None else self._fixed_shots(shots, shots_seed)
        asked = {str(e["question"]) for e in fixed}
        self.train_data = self._create(_hash(seed, "train") % 2**31, train_size)
        # (fixed shots are never held out: the eval split skips their questions)
        self.eval_data = self._create(_hash(seed, "eval") % 2**31, eval_size + 4 * len(asked))
        rows = [i for i in range(len(self.eval_data)) if self.eval_data[i]["question"] not in asked]
        self._eval_rows = rows[:eval_size]
        self._eval_size = len(self._eval_rows)
        self._eval_questions: set[str] | None = None
        self.instruction, self.system, self.error_rate = instruction, system, error_rate
        self.require_marker, self.scorer = require_marker, scorer
        entries = fixed if shots_seed is not None else self._shot_entries(shots)
        self.shots = tuple((e, _fill(shot_reply, e)) for e in entries)

    def _shot_entries(self, n: int) -> list[Entry]:
        """The first ``n`` train entries with distinct questions (never eval ones)."""
        return _distinct((self.entry("train", i) for i in range(_MAX_SKIPS)), n)

    def _fixed_shots(self, n: int, shots_seed: int) -> list[Entry]:
        """The first ``n`` distinct questions of the train split ``shots_seed`` draws:
        the same shots whatever the run's seed (the eval split then skips them)."""
        data = self._create(_hash(shots_seed, "train") % 2**31, max(n * 64, 1))
        return _distinct((data[i] for i in range(len(data))), n)

    def _create(self, seed: int, size: int) -> GymDataset:
        import reasoning_gym  # optional dependency, imported on use

        try:
            data: GymDataset = reasoning_gym.create_dataset(
                self.dataset, seed=seed, size=size, **self.config
            )
        except (TypeError, ValueError, AssertionError) as err:
            raise ValueError(
                f"ReasoningGymTask option config: {self.config} is not valid for "
                f"{self.dataset!r}: {err}"
            ) from err
        return data

    @property
    def eval_size(self) -> int:
        """Number of held-out entries."""
        return self._eval_size

    def entry(self, split: Split, index: int) -> Entry:
        """Entry ``index`` of ``split`` (train wraps around and skips eval questions)."""
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        if split == "eval":
            if index >= self._eval_size:
                raise IndexError(f"eval index {index} out of range [0, {self._eval_size})")
            return self.eval_data[self._eval_rows[index]]
        if split != "train":
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if self._eval_questions is None:
            data = self.eval_data
            self._eval_questions = {str(data[i]["question"]) for i in self._eval_rows}
        size = len(self.train_data)
        for skip in range(_MAX_SKIPS):
            entry = self.train_data[(index + skip * _SKIP_STRIDE) % size]
            if entry["question"] not in self._eval_questions:
                return entry
        raise ValueError(f"no train entry of {self.dataset!r} differs from the eval split")

    def make_env(self, split: Split, index: int) -> ReasoningGymEnv:
        """A fresh environment for entry ``index`` of ``split``."""
        data = self.eval_data if split == "eval" else self.train_data
        return ReasoningGymEnv(
            self.entry(split, index),
            data,
            instruction=self.instruction,
            system=self.system,
            require_marker=self.require_marker,
            scorer=self.scorer,
            shots=self.shots,
        )

    def demonstrations(self, n: int, *, seed: int) -> list[Conversation]:
        """``n`` train entries answered with ``entry['answer']``, ``error_rate`` of them wrongly."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = random.Random(_hash(self.seed, "demos", seed))
        envs = [self.make_env("train", rng.randrange(len(self.train_data))) for _ in range(n)]
        pool = [str(env.entry["answer"]) for env in envs]
        demos = []
        for env in envs:
            answer = str(env.entry["answer"])
            if rng.random() < self.error_rate:
                answer = wrong_answer(answer, pool, rng)
            demos.append(answer_demo(env.first_messages(), answer))
        return demos


def _fill(template: str, entry: Entry) -> str:
    """``template`` with ``{answer}`` and the entry's metadata fields filled in."""
    meta = entry.get("metadata")
    fields = {**(meta if isinstance(meta, Mapping) else {}), "answer": entry["answer"]}
    try:
        return template.format_map(fields)
    except (KeyError, IndexError, ValueError) as err:
        known = ", ".join(sorted(fields))
        raise ValueError(
            f"ReasoningGymTask option shot_reply: {template!r} cannot be filled ({err!r}); "
            f"the fields are {known}"
        ) from err


def _check(ok: bool, option: str, fix: str) -> None:
    """Raise a ``ValueError`` naming ``option`` when ``ok`` is false."""
    if not ok:
        raise ValueError(f"ReasoningGymTask option {option}: {fix}")
