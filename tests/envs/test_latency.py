"""The latency wrapper: reproducible draws, one sleep per reset/step, forwarding."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from sao.envs.base import Env, StepAware, Task
from sao.envs.latency import Distribution, LatencyEnv, LatencyWrapper
from sao.envs.style.shift import StyleShiftTask
from sao.envs.tiny.calculator import CalculatorTask, solve_steps
from tests.envs.conftest import play


class FakeSleep:
    """Records requested delays instead of sleeping."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.calls.append(delay)


def optimal(env: LatencyEnv) -> list[str]:
    steps = solve_steps(env.problem)
    return [f"calc {e}" for e, _ in steps] + [f"answer {steps[-1][1]}"]


def test_one_sleep_per_reset_and_step_with_the_drawn_values() -> None:
    sleep = FakeSleep()
    task = LatencyWrapper(CalculatorTask(), median_s=0.01, sigma=1.0, max_s=0.05, sleep=sleep)
    env = task.make_env("train", 0)
    actions = optimal(env)
    ep = play(env, actions)
    assert ep.score == 1.0
    assert len(env.delays) == 1 + len(actions) and sleep.calls == env.delays
    assert all(0 <= d <= 0.05 for d in env.delays)


def test_draws_are_reproducible_per_seed_and_env_order() -> None:
    def delays(seed: int) -> list[list[float]]:
        task = LatencyWrapper(CalculatorTask(), seed=seed, sleep=FakeSleep())
        envs = [task.make_env("train", i) for i in range(3)]
        for env in envs:
            play(env, ["calc 1+1", "calc 2+2"])
        return [env.delays for env in envs]

    assert delays(7) == delays(7)
    assert delays(7) != delays(8)
    first = delays(7)
    assert first[0] != first[1]  # each env has its own stream


@pytest.mark.parametrize(
    ("distribution", "median"),
    [("lognormal", 0.02), ("exponential", 0.02), ("constant", 0.02)],
)
def test_distributions_have_the_configured_median(
    distribution: Distribution, median: float
) -> None:
    task = LatencyWrapper(
        CalculatorTask(),
        distribution=distribution,
        median_s=median,
        max_s=10.0,
    )
    rng = np.random.default_rng(0)
    draws = np.array([task.draw(rng) for _ in range(4000)])
    assert abs(np.median(draws) / median - 1) < 0.1
    if distribution == "constant":
        assert set(draws.tolist()) == {median}
    else:
        assert draws.max() > 4 * median  # a heavy right tail


def test_delays_are_clipped_to_max() -> None:
    task = LatencyWrapper(CalculatorTask(), median_s=1.0, sigma=3.0, max_s=1.5)
    rng = np.random.default_rng(1)
    draws = [task.draw(rng) for _ in range(500)]
    assert max(draws) == 1.5 and min(draws) < 1.0
    # lognormal: median * exp(sigma * z); with sigma = 0 every draw is the median
    flat = LatencyWrapper(CalculatorTask(), median_s=0.3, sigma=0.0)
    assert flat.draw(rng) == pytest.approx(0.3 * math.exp(0.0))


def test_real_sleep_with_tiny_delays_runs_concurrently() -> None:
    task = LatencyWrapper(CalculatorTask(), median_s=1e-4, max_s=1e-3)
    envs = [task.make_env("eval", i) for i in range(8)]

    async def run(env: LatencyEnv) -> float:
        await env.reset(0)
        for action in optimal(env):
            if (await env.step(action)).done:
                break
        return env.score()

    async def main() -> list[float]:
        return list(await asyncio.gather(*(run(e) for e in envs)))

    assert asyncio.run(main()) == [1.0] * 8
    assert task.envs_made == 8 and all(len(e.delays) >= 3 for e in envs)


def test_forwards_the_task_contract() -> None:
    inner = CalculatorTask(eval_size=17)
    task = LatencyWrapper(inner, sleep=FakeSleep())
    assert isinstance(task, Task) and isinstance(task.make_env("train", 0), Env)
    assert task.name == "calculator" and task.eval_size == 17
    assert task.demonstrations(3, seed=1) == inner.demonstrations(3, seed=1)
    assert not isinstance(task, StepAware)
    assert task.make_env("eval", 2).problem == inner.make_env("eval", 2).problem


def test_step_aware_inner_task() -> None:
    inner = StyleShiftTask()
    task = LatencyWrapper(inner, sleep=FakeSleep())
    assert isinstance(task, StepAware)
    task.set_train_step(200)
    assert inner.train_step == 200
    assert task.make_env("train", 0).preferred == "chuunibyou"
    env = task.make_eval_env(0, "classical")
    assert isinstance(env, LatencyEnv) and env.preferred == "classical"


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"distribution": "pareto"}, "distribution"),
        ({"median_s": -1.0}, "median_s"),
        ({"sigma": float("nan")}, "sigma"),
        ({"median_s": 2.0, "max_s": 1.0}, "max_s"),
    ],
)
def test_options_are_validated(kwargs: dict[str, object], option: str) -> None:
    with pytest.raises(ValueError, match=f"option {option}"):
        LatencyWrapper(CalculatorTask(), **kwargs)  # type: ignore[arg-type]
