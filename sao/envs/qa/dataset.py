"""``dataset``: single-turn prompts and reference answers from local files.

Sources: JSON Lines (``.jsonl``, or ``.json`` holding lines or one list),
Parquet (``.parquet``) or a directory written by ``datasets``'
``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` whose split is picked by
``train_split`` / ``eval_split``). Nothing is downloaded. Field names are set
by ``prompt_key`` and ``answer_key``; a prompt is text or a list of chat
messages (``{"role", "content"}``). Without an eval file, a deterministic
held-out share (``eval_fraction``, by a hash of the prompt) is the eval split.
An episode::

    user:      What is 1/4 + 1/4?
               Finish with 'answer X'.
    assistant: answer \\boxed{1/2}

Scorers (``scorer``): ``"math"`` (math-verify equivalence of the final answer
and the reference: ``\\boxed{1/2}`` matches ``0.5``), ``"exact"`` (normalised
text equality) or any callable ``(response, answer) -> float`` (given the whole
reply). The final answer comes from a marker: what follows the last line
starting with ``answer``, else the last ``\\boxed{...}``, else an ``<answer>``
tag (:func:`~sao.envs.qa.answers.extract_answer`); a reply without one scores 0
and reports ``metric/format/missing_answer``. ``require_marker=False`` scores
the whole reply instead, which a policy can game by echoing the question's
computation (``16 - 45`` for ``What is 16 - 45?``); ``require_value=False``
lets ``"math"`` accept an expression for a numeric reference (both in
:mod:`sao.envs.qa.answers`). A scorer that raises, or returns something that is
not a finite number, gives reward 0 and its reason in the step's ``info``.
"""

from __future__ import annotations

import json
import math
import numbers
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from sao.envs._split import stable_hash
from sao.envs._state import expect_same, read, read_optional
from sao.envs._tools import as_observation
from sao.envs.base import Conversation, Message, Observation, Split, StepResult
from sao.envs.qa.answers import MISSING_ANSWER, exact_score, extract_answer, math_score

__all__ = [
    "INSTRUCTION",
    "DatasetEnv",
    "DatasetTask",
    "Example",
    "exact_score",
    "extract_answer",
    "load_examples",
    "math_score",
    "safe_score",
]

Scorer = Callable[[str, str], float]
"""``(response, reference answer) -> reward``."""
Prompt = str | tuple[Message, ...]
INSTRUCTION = "Finish with 'answer X'."
_SCALE = 1_000_000


@dataclass(frozen=True)
class Example:
    """One prompt (text or chat messages) and its reference answer."""

    prompt: Prompt
    answer: str

    @property
    def prompt_text(self) -> str:
        """The prompt as one string (for hashing and messages)."""
        if isinstance(self.prompt, str):
            return self.prompt
        return "\n".join(f"{m.role}: {m.content}" for m in self.prompt)


def safe_score(scorer: Callable[[], object]) -> tuple[float, str | None]:
    """Call ``scorer``; (reward, None) on success, (0.0, reason) if it raises
    or returns something that is not a finite number."""
    try:
        value = scorer()
    except Exception as err:  # a scorer's failure is a zero reward, never a crash
        return 0.0, f"scorer raised {type(err).__name__}: {err}"[:300]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return 0.0, f"scorer returned {type(value).__name__}, expected a float"
    if not math.isfinite(float(value)):
        return 0.0, f"scorer returned {value}, expected a finite float"
    return float(value), None


def _read_rows(path: Path, option: str, split_name: str) -> list[dict[str, object]]:
    """Rows of a JSONL / JSON / Parquet file or a ``save_to_disk`` directory."""
    if not path.exists():
        raise FileNotFoundError(f"DatasetTask option {option}: {path} does not exist")
    if path.is_dir():
        import datasets  # optional dependency, imported on use

        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if split_name not in data:
                raise ValueError(
                    f"DatasetTask option {option}: {path} has splits {sorted(data)}, "
                    f"not {split_name!r}; set train_split/eval_split to one of them"
                )
            data = data[split_name]
        return list(data)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # optional dependency, imported on use

        return pq.read_table(path).to_pylist()
    if suffix in (".jsonl", ".json"):
        text = path.read_text(encoding="utf-8")
        if text.lstrip().startswith("["):
            return list(json.loads(text))
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(
                        f"DatasetTask option {option}: {path} line {n}: {err}"
                    ) from err
        return rows
    raise ValueError(
        f"DatasetTask option {option}: {path} is not a .jsonl/.json/.parquet file "
        "or a save_to_disk directory"
    )


def _to_prompt(value: object, where: str) -> Prompt:
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence) and value and all(isinstance(m, dict) for m in value):
        try:
            return tuple(Message(str(m["role"]), str(m["content"])) for m in value)  # type: ignore[arg-type]
        except KeyError as err:
            raise ValueError(f"{where}: chat messages need 'role' and 'content'") from err
    raise ValueError(f"{where}: a prompt must be text or a list of chat messages")


def load_examples(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    split: str = "train",
    option: str = "path",
) -> list[Example]:
    """Read ``path`` into examples; errors name the file, the row and the field."""
    rows = _read_rows(Path(path), option, split)
    if not rows:
        raise ValueError(f"DatasetTask option {option}: {path} has no rows")
    examples = []
    for i, row in enumerate(rows):
        where = f"{path} row {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object with fields, got {type(row).__name__}")
        for key, arg in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
            if key not in row:
                raise ValueError(
                    f"{where} has no field {key!r} (fields: {sorted(row)}); "
                    f"set {arg} to the field that holds it"
                )
        answer = row[answer_key]
        text = answer if isinstance(answer, str) else json.dumps(answer)
        examples.append(Example(_to_prompt(row[prompt_key], where), text))
    return examples


class DatasetEnv:
    """One single-turn episode: show the prompt, score the reply."""

    def __init__(
        self, example: Example, scorer: Scorer, *, instruction: str | None, system: str | None
    ) -> None:
        self.example = example
        self.scorer = scorer
        self.instruction = instruction
        self.system = system
        self.reward = 0.0
        self.error: str | None = None
        self.done = False

    def first_messages(self) -> list[Message]:
        """The prompt with the instruction appended, after the system message if set."""
        prompt = self.example.prompt
        msgs = [Message("user", prompt)] if isinstance(prompt, str) else list(prompt)
        if self.instruction:
            last = msgs[-1]
            msgs[-1] = Message(last.role, f"{last.content}\n{self.instruction}")
        if self.system and msgs[0].role != "system":
            msgs.insert(0, Message("system", self.system))
        return msgs

    def first_observation(self) -> Observation:
        """What ``reset`` returns: plain text for a lone user message, else the messages."""
        return as_observation(self.first_messages())

    async def reset(self, seed: int) -> Observation:
        """Start the episode; the example is fixed, ``seed`` is unused."""
        self.reward, self.error, self.done = 0.0, None, False
        return self.first_observation()

    async def step(self, action: str) -> StepResult:
        """Score the reply and end the episode."""
        if self.done:
            return StepResult(None, done=True, info={"error": "episode is over"})
        self.done = True
        self.reward, self.error = safe_score(lambda: self.scorer(action, self.example.answer))
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
        """The episode so far (``RestorableEnv``); the scorer is the task's."""
        return {
            "prompt": self.example.prompt_text,
            "reference": self.example.answer,
            "reward": self.reward,
            "error": self.error,
            "done": self.done,
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Continue the episode :meth:`state_dict` recorded (same example only)."""
        expect_same(state, "prompt", self.example.prompt_text)
        expect_same(state, "reference", self.example.answer)
        self.reward = read(state, "reward", float)
        self.error = read_optional(state, "error", str)
        self.done = read(state, "done", bool)


def _resolve_scorer(scorer: str | Scorer, *, require_marker: bool, require_value: bool) -> Scorer:
    """The scorer named ``scorer`` with the task's answer rules, or the callable itself."""
    if callable(scorer):
        return scorer
    named: dict[str, Scorer] = {
        "math": partial(math_score, require_marker=require_marker, require_value=require_value),
        "exact": partial(exact_score, require_marker=require_marker),
    }
    if scorer not in named:
        raise ValueError(
            f"DatasetTask option scorer: {scorer!r} is not 'math', 'exact' or a callable "
            "(response, answer) -> float"
        )
    return named[scorer]


def wrong_answer(answer: str, pool: Sequence[str], rng: random.Random) -> str:
    """A plausible wrong answer: another example's, or an integer off by one."""
    others = [a for a in rng.sample(list(pool), min(len(pool), 8)) if a != answer]
    if answer.lstrip("-").isdigit() and (not others or rng.random() < 0.5):
        return str(int(answer) + rng.choice((-1, 1)))
    return others[0] if others else answer + "0"


def answer_demo(messages: Sequence[Message], answer: str) -> Conversation:
    """A one-reply demonstration: the prompt's messages, then ``answer X``."""
    return (*messages, Message("assistant", f"answer {answer}"))


class DatasetTask:
    """Single-turn prompts with reference answers from local files (module docstring).

    ``eval_path`` is optional: without it (and without an ``eval_split`` in a
    saved ``DatasetDict``), ``eval_fraction`` of the train file is held out.
    ``eval_limit`` caps the eval split. ``instruction`` is appended to each
    prompt (None for none); ``system`` is an optional system message;
    ``error_rate`` is the share of demonstrations with a wrong answer.

    For the named scorers: ``require_marker`` (default True) scores a reply
    without an ``answer`` line, ``\\boxed{}`` or ``<answer>`` tag 0; False
    scores the whole reply, which a policy can game by echoing a computation
    the question contains. ``require_value`` (default True) scores 0 an
    expression (``16 - 45``) given for a numeric reference (``-29``); set it
    False when a dataset's numeric answers may be written as expressions.
    """

    name = "dataset"

    def __init__(
        self,
        train_path: str | Path,
        eval_path: str | Path | None = None,
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        scorer: str | Scorer = "math",
        train_split: str = "train",
        eval_split: str = "test",
        eval_fraction: float = 0.1,
        eval_limit: int | None = None,
        instruction: str | None = INSTRUCTION,
        system: str | None = None,
        error_rate: float = 0.3,
        require_marker: bool = True,
        require_value: bool = True,
        seed: int = 0,
    ) -> None:
        _check(0.0 < eval_fraction < 1.0, "eval_fraction", "use a value in (0, 1)")
        _check(eval_limit is None or eval_limit >= 1, "eval_limit", "use None or 1 or more")
        _check(0.0 <= error_rate <= 1.0, "error_rate", "use a value in [0, 1]")
        _check(isinstance(require_marker, bool), "require_marker", "use true or false")
        _check(isinstance(require_value, bool), "require_value", "use true or false")
        self.scorer = _resolve_scorer(
            scorer, require_marker=require_marker, require_value=require_value
        )
        keys = {"prompt_key": prompt_key, "answer_key": answer_key}
        train = load_examples(train_path, split=train_split, option="train_path", **keys)
        if eval_path is not None:
            evals = load_examples(eval_path, split=eval_split, option="eval_path", **keys)
        elif _has_split(Path(train_path), eval_split):
            evals = load_examples(train_path, split=eval_split, option="train_path", **keys)
        else:
            cut = int(eval_fraction * _SCALE)
            held = [stable_hash(seed, e.prompt_text) % _SCALE < cut for e in train]
            evals = [e for e, h in zip(train, held, strict=True) if h]
            train = [e for e, h in zip(train, held, strict=True) if not h]
            _check(bool(evals) and bool(train), "eval_fraction", "no example fell in one split")
        random.Random(stable_hash(seed, "order")).shuffle(train)
        self.train = train
        self.eval = evals[:eval_limit] if eval_limit else evals
        self.instruction, self.system = instruction, system
        self.error_rate, self.seed = error_rate, seed

    @property
    def eval_size(self) -> int:
        """Number of held-out examples."""
        return len(self.eval)

    def example(self, split: Split, index: int) -> Example:
        """Example ``index`` of ``split`` (the train split wraps around)."""
        if split == "train":
            return self.train[index % len(self.train)]
        if split == "eval":
            if not 0 <= index < len(self.eval):
                raise IndexError(f"eval index {index} out of range [0, {len(self.eval)})")
            return self.eval[index]
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")

    def make_env(self, split: Split, index: int) -> DatasetEnv:
        """A fresh environment for example ``index`` of ``split``."""
        example = self.example(split, index)
        return DatasetEnv(example, self.scorer, instruction=self.instruction, system=self.system)

    def demonstrations(self, n: int, *, seed: int) -> list[Conversation]:
        """``n`` train examples answered with their reference, ``error_rate`` of them wrongly."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = random.Random(stable_hash(self.seed, "demos", seed))
        pool = [e.answer for e in self.train]
        demos = []
        for _ in range(n):
            env = self.make_env("train", rng.randrange(len(self.train)))
            answer = env.example.answer
            if rng.random() < self.error_rate:
                answer = wrong_answer(answer, pool, rng)
            demos.append(answer_demo(env.first_messages(), answer))
        return demos


def _has_split(path: Path, split: str) -> bool:
    """True when ``path`` is a saved ``DatasetDict`` with split ``split``."""
    dict_file = path / "dataset_dict.json"
    if not dict_file.is_file():
        return False
    return split in json.loads(dict_file.read_text()).get("splits", [])


def _check(ok: bool, option: str, fix: str) -> None:
    """Raise a ``ValueError`` naming ``option`` when ``ok`` is false."""
    if not ok:
        raise ValueError(f"DatasetTask option {option}: {fix}")
