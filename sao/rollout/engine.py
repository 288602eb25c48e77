"""The ``Engine`` protocol: what the agent loop and the runtime need from a
generator, whether an embedded torch model or an external server."""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from sao.rollout.weights import WeightSource
from sao.types import Completion, SamplingParams


@runtime_checkable
class Engine(Protocol):
    """Token in, token out generation with exact log-probabilities.

    ``generate`` returns the sampled ids, the log-probability of each under the
    distribution actually sampled from, and the weight version that sampled
    each token. ``update_weights`` may be awaited while requests are in
    flight; it returns once the new weights are in force, and tokens sampled
    after it carry ``source.version``. ``weight_sources`` lists the kinds of
    :data:`~sao.rollout.weights.WeightSource` the engine accepts, preferred
    first (the publisher builds the first kind every engine accepts).
    """

    @property
    def version(self) -> int: ...

    @property
    def weight_sources(self) -> tuple[type, ...]: ...

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion: ...

    async def update_weights(self, source: WeightSource) -> None: ...

    async def aclose(self) -> None: ...


episode_key: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "sao_episode_key", default=None
)
"""The episode the current generation belongs to: ``run_episode`` sets it for
the duration of an episode, so a router can keep an episode on one engine."""
