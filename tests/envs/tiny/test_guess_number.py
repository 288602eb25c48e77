"""The guess-number task: binary search wins, robustness, splits, demonstrations."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from sao.envs.base import Conversation, Env, Task
from sao.envs.registry import make_task
from sao.envs.tiny.guess_number import GuessNumberEnv, GuessNumberTask
from tests.envs.conftest import Episode, play, play_policy, replay

FORMAT_HINT = "reply 'guess N', N a number in 1-32"


def binary_search(env: GuessNumberEnv) -> Episode:
    """Play the optimal policy, narrowing [lo, hi] from each observation."""
    lo, hi = 1, env.n
    last = 0

    def policy(obs: str) -> str:
        nonlocal lo, hi, last
        if obs == "higher":
            lo = last + 1
        elif obs == "lower":
            hi = last - 1
        last = (lo + hi) // 2
        return f"guess {last}"

    return play_policy(env, policy)


def test_protocols_and_defaults() -> None:
    task = GuessNumberTask()
    assert isinstance(task, Task) and isinstance(task.make_env("eval", 0), Env)
    assert task.n == 32 and task.max_turns == 6  # ceil(log2 32) + 1
    assert GuessNumberTask(n=100).max_turns == 8  # ceil(6.64) + 1
    assert make_task("guess_number", n=8).max_turns == 4  # type: ignore[attr-defined]


def test_example_episode() -> None:
    env = GuessNumberEnv(21, n=32, max_turns=6, system=False)
    ep = play(env, ["guess 16", "guess 24", "guess 20", "guess 22", "guess 21"])
    assert ep.first == "guess a number in 1-32, 6 tries"
    assert ep.observations == ["higher", "lower", "higher", "lower", None]
    assert ep.done and ep.score == 1.0


@pytest.mark.parametrize("n", [2, 7, 32, 100])
def test_binary_search_always_wins(n: int) -> None:
    task = GuessNumberTask(n=n)
    for target in range(1, n + 1):
        env = GuessNumberEnv(target, n=n, max_turns=task.max_turns, system=False)
        assert binary_search(env).score == 1.0, (n, target)


def test_running_out_of_turns_scores_zero() -> None:
    env = GuessNumberEnv(32, n=32, max_turns=6, system=False)
    ep = play(env, [f"guess {g}" for g in range(1, 10)])
    assert len(ep.results) == 6 and ep.done and ep.score == 0.0
    assert ep.observations[:5] == ["higher"] * 5 and ep.observations[5] is None


@pytest.mark.parametrize(
    ("action", "hint"),
    [
        ("", FORMAT_HINT),
        ("guess", FORMAT_HINT),
        ("guess seventeen", FORMAT_HINT),
        ("17", FORMAT_HINT),
        ("guess 1.5", FORMAT_HINT),
        ("x" * 100_000, FORMAT_HINT),
        ("guess " + "9" * 50_000, FORMAT_HINT),
        ("guess 0", "out of range 1-32"),
        ("guess 33", "out of range 1-32"),
        ("guess -4", "out of range 1-32"),
    ],
)
def test_malformed_guesses_get_hints_and_zero(action: str, hint: str) -> None:
    env = GuessNumberTask().make_env("train", 0)
    ep = play(env, [action] * 10)
    assert ep.observations[0] == hint
    assert ep.done and ep.score == 0.0 and len(ep.results) == 6
    assert ep.results[-1].info["wasted"] == 6 and env.guesses == []


def test_lenient_parsing() -> None:
    env = GuessNumberEnv(5, n=32, max_turns=6, system=False)
    assert play(env, ["I think...\nGuess: 5."]).score == 1.0


def test_score_always_works_and_steps_after_done() -> None:
    env = GuessNumberEnv(1, n=4, max_turns=3, system=False)
    assert env.score() == 0.0
    play(env, ["guess 1"])
    after = asyncio.run(env.step("guess 2"))
    assert after.done and env.score() == 1.0


def test_eval_targets_are_balanced_and_deterministic() -> None:
    task = GuessNumberTask(seed=1)
    counts = Counter(task.target("eval", i) for i in range(96))
    assert set(counts) == set(range(1, 33)) and set(counts.values()) == {3}
    assert [task.target("train", i) for i in range(50)] == [
        GuessNumberTask(seed=1).target("train", i) for i in range(50)
    ]
    assert [task.target("train", i) for i in range(50)] != [
        GuessNumberTask(seed=2).target("train", i) for i in range(50)
    ]
    assert all(1 <= task.target("train", i) <= 32 for i in range(500))


def consistent_targets(conv: Conversation) -> list[int]:
    """Hidden numbers for which the env reproduces the demonstration exactly.

    Candidates come from the feedback; each is confirmed by a replay.
    """
    lo, hi, last = 1, 32, 0
    for m in conv[1:]:
        if m.role == "assistant":
            last = int(m.content.split()[1])
        elif m.content == "higher":
            lo = max(lo, last + 1)
        elif m.content == "lower":
            hi = min(hi, last - 1)
    fits = []
    for target in range(lo, hi + 1):
        try:
            replay(GuessNumberEnv(target, n=32, max_turns=6, system=False), conv)
            fits.append(target)
        except AssertionError:
            pass
    return fits


def test_demonstrations_replay_and_are_imperfect() -> None:
    task = GuessNumberTask(error_rate=0.3)
    demos = task.demonstrations(40, seed=0)
    assert demos == task.demonstrations(40, seed=0)
    assert demos != task.demonstrations(40, seed=1)
    detours = 0
    for conv in demos:
        assert consistent_targets(conv), conv
        guesses = [m.content for m in conv if m.role == "assistant"]
        detours += guesses[0] != "guess 16" or len(set(guesses)) < len(guesses)
    assert 4 < detours < 36


def test_noisy_demonstrations_replay_even_when_failing() -> None:
    demos = GuessNumberTask(error_rate=1.0).demonstrations(30, seed=3)
    assert all(consistent_targets(conv) for conv in demos)
    assert any(sum(m.role == "assistant" for m in conv) == 6 for conv in demos)


def test_clean_demonstrations_are_binary_searches() -> None:
    for conv in GuessNumberTask(error_rate=0.0).demonstrations(30, seed=2):
        guesses = [int(m.content.split()[1]) for m in conv if m.role == "assistant"]
        assert guesses[0] == 16
        assert consistent_targets(conv) == [guesses[-1]]  # found on the last guess


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [({"n": 1}, "n"), ({"max_turns": 0}, "max_turns"), ({"error_rate": -0.1}, "error_rate")],
)
def test_options_are_validated(kwargs: dict[str, int], option: str) -> None:
    with pytest.raises(ValueError, match=f"option {option}"):
        GuessNumberTask(**kwargs)  # type: ignore[arg-type]


def test_system_message_option() -> None:
    env = GuessNumberTask(system=True).make_env("train", 0)
    first = play(env, []).first
    assert isinstance(first, tuple)
    assert [getattr(m, "role", None) for m in first] == ["system", "user"]


def test_in_interval_counts_guesses_the_feedback_allows() -> None:
    # hidden 21 in 1-32: 16 -> higher [17, 32]; 24 -> lower [17, 23]; 12 is excluded
    # by the first answer; 24 again is excluded; 20 is inside: after the first guess
    # 1/1, 1/2, 1/3, 2/4
    env = GuessNumberEnv(21, n=32, max_turns=6, system=False)
    ep = play(env, ["guess 16", "guess 24", "guess 12", "guess 24", "guess 20"])
    infos = [r.info for r in ep.results]
    assert "metric/guess/in_interval" not in infos[0]
    assert [i["metric/guess/in_interval"] for i in infos[1:]] == [1.0, 1 / 2, 1 / 3, 2 / 4]
    assert infos[-1]["metric/guess/turns"] == 5.0 and infos[-1]["metric/guess/wasted"] == 0.0


def test_shots_are_fixed_binary_searches_before_the_prompt() -> None:
    task = GuessNumberTask(n=16, shots=2, seed=3)
    obs = task.make_env("eval", 0).first_observation()
    assert isinstance(obs, tuple) and obs[-1].content == "guess a number in 1-16, 5 tries"
    shots = obs[:-1]
    assert GuessNumberTask(n=16, shots=2, seed=9).shots == shots  # the same for every run seed
    assert GuessNumberTask(n=16, shots=2, shots_seed=1).shots != shots
    games = [i for i, m in enumerate(shots) if m.content.startswith("guess a number")]
    assert len(games) == 2 and shots[0].role == "user"
    for start, end in zip(games, [*games[1:], len(shots)], strict=True):
        game = shots[start:end]
        guesses = [int(m.content.split()[1]) for m in game if m.role == "assistant"]
        feedback = [m.content for m in game[2::2]]
        assert guesses[0] == 8 and len(guesses) == len(feedback) + 1 <= 5
        lo, hi = 1, 16
        for g, f in zip(guesses, feedback, strict=False):  # each guess is the midpoint
            assert g == (lo + hi) // 2 and f in ("higher", "lower")
            lo, hi = (g + 1, hi) if f == "higher" else (lo, g - 1)
        assert guesses[-1] == (lo + hi) // 2
        assert len(guesses) >= 3
    # the first game's number is in the upper half, the second's in the lower: both
    # answers are shown followed
    finals = [int(shots[end - 1].content.split()[1]) for end in [*games[1:], len(shots)]]
    assert finals[0] > 8 >= finals[1]


def test_shots_follow_the_system_message() -> None:
    obs = GuessNumberTask(n=8, shots=1, system=True).make_env("train", 0).first_observation()
    assert isinstance(obs, tuple)
    assert [m.role for m in obs[:2]] == ["system", "user"] and obs[1].content.startswith("guess a")
