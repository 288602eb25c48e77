"""The ``Engine`` protocol: what the agent loop and the runtime need from a
generator, whether an embedded torch model or an external server."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from sao.types import Completion, SamplingParams


@runtime_checkable
class Engine(Protocol):
    """Token in, token out generation with exact log-probabilities.

    ``generate`` returns the sampled ids, the log-probability of each under the
    distribution actually sampled from, and the weight version that sampled
    each token. ``update_weights`` may be called while requests are in flight;
    tokens sampled after it carry the new ``version``.
    """

    @property
    def version(self) -> int: ...

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion: ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None: ...
