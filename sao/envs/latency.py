"""Simulated environment latency: a Task wrapper whose envs sleep before every
``reset`` and ``step``, to model real tool or sandbox latency in benchmarks.

Delays (seconds, clipped to ``max_s``):

- ``lognormal``: ``median_s * exp(sigma * z)``, ``z ~ N(0, 1)`` (heavy right tail);
- ``exponential``: rate ``ln 2 / median_s``, so its median is ``median_s``;
- ``constant``: ``median_s``.

The k-th env a wrapper makes (counting from 0) draws from a generator seeded
by ``(seed, k)``, so a run that makes envs in the same order sees the same
delays. Sleeping uses ``asyncio.sleep`` and never blocks the event loop.

A wrapped env is a ``RestorableEnv`` exactly when the inner env is one: then
it is a :class:`RestorableLatencyEnv`, whose state is its generator's state
and delays plus the inner env's state; otherwise a plain :class:`LatencyEnv`,
which has no ``state_dict`` at all (so ``isinstance(env, RestorableEnv)``
stays truthful rather than claiming a state it cannot restore).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import numpy as np

from sao.envs._state import read, read_list
from sao.envs.base import Conversation, Env, Observation, RestorableEnv, Split, StepResult, Task

__all__ = ["Distribution", "LatencyEnv", "LatencyWrapper", "RestorableLatencyEnv"]
_STATE_METHODS = ("state_dict", "load_state_dict")

Distribution = Literal["lognormal", "exponential", "constant"]
_DISTRIBUTIONS = ("lognormal", "exponential", "constant")
Sleep = Callable[[float], Awaitable[None]]


class LatencyEnv:
    """An env that sleeps a drawn delay before each ``reset`` and ``step`` of ``inner``.

    ``delays`` lists every delay drawn so far, in call order.
    """

    def __init__(
        self,
        inner: Env,
        draw: Callable[[np.random.Generator], float],
        rng: np.random.Generator,
        sleep: Sleep,
    ) -> None:
        self.inner = inner
        self.delays: list[float] = []
        self._draw = draw
        self._rng = rng
        self._sleep = sleep

    async def _wait(self) -> None:
        delay = self._draw(self._rng)
        self.delays.append(delay)
        await self._sleep(delay)

    async def reset(self, seed: int) -> Observation:
        """Sleep, then reset the inner env."""
        await self._wait()
        return await self.inner.reset(seed)

    async def step(self, action: str) -> StepResult:
        """Sleep, then step the inner env."""
        await self._wait()
        return await self.inner.step(action)

    def score(self) -> float:
        """The inner env's score (never delayed)."""
        return self.inner.score()

    def __getattr__(self, name: str) -> Any:
        # Expose the inner env's typed state (e.g. ``env.target``) for inspection;
        # ``Any`` because the attribute belongs to whichever env is wrapped.
        # Never the state methods: the inner env's state lacks this env's
        # generator, so forwarding them would make a restore silently wrong.
        if name.startswith("_") or name == "inner" or name in _STATE_METHODS:
            raise AttributeError(name)
        return getattr(self.inner, name)


class RestorableLatencyEnv(LatencyEnv):
    """A :class:`LatencyEnv` over a ``RestorableEnv``, itself restorable: its
    state is the generator's state, the delays so far and the inner env's state."""

    def __init__(
        self,
        inner: Env,
        draw: Callable[[np.random.Generator], float],
        rng: np.random.Generator,
        sleep: Sleep,
    ) -> None:
        if not isinstance(inner, RestorableEnv):
            raise TypeError(
                f"RestorableLatencyEnv needs a RestorableEnv, got {type(inner).__name__} "
                "(no state_dict/load_state_dict); wrap it in a plain LatencyEnv"
            )
        super().__init__(inner, draw, rng, sleep)
        self._restorable = inner

    def state_dict(self) -> dict[str, object]:
        """The delays so far, the generator's state and the inner env's state."""
        return {
            "delays": list(self.delays),
            "rng": dict(self._rng.bit_generator.state),
            "inner": self._restorable.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Continue the delays and the inner episode :meth:`state_dict` recorded."""
        delays = read_list(state, "delays", float)
        inner = read(state, "inner", dict)
        generator = self._rng.bit_generator
        try:
            generator.state = read(state, "rng", dict)
        except (KeyError, TypeError) as err:  # numpy's own errors for a malformed state
            name = type(generator).__name__
            raise ValueError(f"env state 'rng': not a {name} state ({err!r})") from err
        self._restorable.load_state_dict(inner)
        self.delays = delays


class LatencyWrapper:
    """A Task whose envs are delayed by draws from a latency distribution.

    Forwards ``name``, ``eval_size`` and ``demonstrations``; any other
    attribute (``set_train_step``, ``make_eval_env``, ...) is the inner task's,
    so the wrapper is ``StepAware`` exactly when the inner task is. Envs from
    ``make_eval_env`` are wrapped too; :meth:`wrap_env` wraps any other env,
    as a :class:`RestorableLatencyEnv` when it is a ``RestorableEnv``.
    ``sleep`` replaces ``asyncio.sleep`` (for tests).
    """

    def __init__(
        self,
        task: Task,
        *,
        distribution: Distribution = "lognormal",
        median_s: float = 0.05,
        sigma: float = 1.0,
        max_s: float = 2.0,
        seed: int = 0,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if distribution not in _DISTRIBUTIONS:
            raise ValueError(
                f"LatencyWrapper option distribution: use one of {_DISTRIBUTIONS}, "
                f"got {distribution!r}"
            )
        if not (math.isfinite(median_s) and median_s >= 0):
            raise ValueError(f"LatencyWrapper option median_s: use a value >= 0, got {median_s}")
        if not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"LatencyWrapper option sigma: use a value >= 0, got {sigma}")
        if not (math.isfinite(max_s) and max_s >= median_s):
            raise ValueError(
                f"LatencyWrapper option max_s: must be finite and >= median_s ({median_s}), "
                f"got {max_s}"
            )
        self.task = task
        self.name = task.name
        self.distribution = distribution
        self.median_s = median_s
        self.sigma = sigma
        self.max_s = max_s
        self.seed = seed
        self.envs_made = 0
        self._sleep = sleep

    @property
    def eval_size(self) -> int:
        """The inner task's number of held-out problems."""
        return self.task.eval_size

    def draw(self, rng: np.random.Generator) -> float:
        """One delay in seconds from the configured distribution, clipped to ``max_s``."""
        if self.distribution == "constant" or self.median_s == 0:
            delay = self.median_s
        elif self.distribution == "lognormal":
            delay = self.median_s * math.exp(self.sigma * float(rng.standard_normal()))
        else:
            delay = float(rng.exponential(self.median_s / math.log(2)))
        return min(delay, self.max_s)

    def wrap_env(self, env: Env) -> LatencyEnv:
        """Wrap ``env``; it draws from the next stream ``(seed, envs_made)``."""
        rng = np.random.default_rng([self.seed, self.envs_made])
        self.envs_made += 1
        cls = RestorableLatencyEnv if isinstance(env, RestorableEnv) else LatencyEnv
        return cls(env, self.draw, rng, self._sleep)

    def make_env(self, split: Split, index: int) -> LatencyEnv:
        """The inner task's env for ``(split, index)``, delayed."""
        return self.wrap_env(self.task.make_env(split, index))

    def demonstrations(self, n: int, *, seed: int) -> list[Conversation]:
        """The inner task's demonstrations (latency does not change them)."""
        return self.task.demonstrations(n, seed=seed)

    def __getattr__(self, name: str) -> Any:
        # ``Any`` because the attribute belongs to whichever task is wrapped.
        if name.startswith("_") or name == "task":
            raise AttributeError(name)
        attr = getattr(self.task, name)
        if name == "make_eval_env" and callable(attr):
            inner: Callable[..., Env] = attr

            def make_eval_env(*args: object, **kwargs: object) -> LatencyEnv:
                return self.wrap_env(inner(*args, **kwargs))

            return make_eval_env
        return attr
