"""Where episodes run: the seam between the orchestrator and the rollout side.

An :class:`EpisodeRunner` plays one episode of the task, by split and index,
and returns its trajectory. :class:`LocalRunner` does so in this process
(the task's environment and ``run_episode`` over an engine); the Ray backend
runs it in rollout-worker actors that own their engines and environments.
The orchestrator, evaluation and the log-probability preflight only ever see
a runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from sao.envs.base import Split, StepAware, Task
from sao.rollout.agent import EpisodeLimits, run_episode
from sao.rollout.engine import Engine
from sao.types import SamplingParams, Trajectory

__all__ = ["EpisodeRunner", "LocalRunner"]


class EpisodeRunner(Protocol):
    """Plays episodes of one task (see the module docstring)."""

    @property
    def eval_size(self) -> int: ...

    async def run(
        self,
        split: Split,
        index: int,
        *,
        seed: int,
        prompt_id: str,
        group_id: str,
        sampling: SamplingParams,
    ) -> Trajectory: ...

    def set_train_step(self, step: int) -> None:
        """Tell step-aware tasks (e.g. the online style-shift schedule) the step."""
        ...

    def metrics(self) -> dict[str, float]:
        """Counters of the rollout side (e.g. ``workers/replaced``)."""
        ...


@dataclass
class LocalRunner:
    """Episodes in this process: ``task.make_env`` + ``run_episode`` on ``engine``."""

    task: Task
    engine: Engine
    tokenizer: PreTrainedTokenizerBase
    limits: EpisodeLimits

    @property
    def eval_size(self) -> int:
        return self.task.eval_size

    async def run(
        self,
        split: Split,
        index: int,
        *,
        seed: int,
        prompt_id: str,
        group_id: str,
        sampling: SamplingParams,
    ) -> Trajectory:
        env = self.task.make_env(split, index)
        return await run_episode(
            env,
            self.engine,
            self.tokenizer,
            sampling,
            self.limits,
            seed=seed,
            prompt_id=prompt_id,
            group_id=group_id,
        )

    def set_train_step(self, step: int) -> None:
        if isinstance(self.task, StepAware):
            self.task.set_train_step(step)

    def metrics(self) -> dict[str, float]:
        return {}
