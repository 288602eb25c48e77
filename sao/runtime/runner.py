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
from sao.rollout.envcall import describe_error
from sao.rollout.resume import EpisodeResume, resume_points
from sao.types import Env, RestorableEnv, SamplingParams, Trajectory, failed_trajectory

__all__ = ["EpisodeRunner", "LocalRunner", "samples"]

Played = Trajectory | list[Trajectory]
"""An episode's training samples: one trajectory, or several (an agent episode
exported per model call, :mod:`sao.agents.export`)."""


def samples(played: Played) -> list[Trajectory]:
    """The trajectories of an episode, as a list."""
    return played if isinstance(played, list) else [played]


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
        resume: EpisodeResume | None = None,
    ) -> Played:
        """Play the episode (on from ``resume``, a checkpointed history, if given)."""
        ...

    async def take_resumes(self, keys: list[str]) -> dict[str, EpisodeResume]:
        """Snapshots of the running episodes ``keys`` that can be continued after
        a checkpoint (:mod:`sao.rollout.resume`); the others are absent."""
        ...

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
        resume: EpisodeResume | None = None,
    ) -> Trajectory:
        try:
            env = self.task.make_env(split, index)
            if resume is not None and not _restored(env, resume):
                resume, env = None, self.task.make_env(split, index)  # from scratch
        except Exception as err:  # the task's own bug or bad data: this episode fails
            why = f"make_env({split!r}, {index}) raised {describe_error(err)}"
            return failed_trajectory(prompt_id, group_id, sampling, "error", why)
        return await run_episode(
            env,
            self.engine,
            self.tokenizer,
            sampling,
            self.limits,
            seed=seed,
            prompt_id=prompt_id,
            group_id=group_id,
            resume=resume,
        )

    async def take_resumes(self, keys: list[str]) -> dict[str, EpisodeResume]:
        taken = {key: resume_points.take(key) for key in keys}
        return {key: r for key, r in taken.items() if r is not None}

    def set_train_step(self, step: int) -> None:
        if isinstance(self.task, StepAware):
            self.task.set_train_step(step)

    def metrics(self) -> dict[str, float]:
        return {}


def _restored(env: Env, resume: EpisodeResume) -> bool:
    """Load the checkpointed state into a fresh ``env``; False if it cannot be."""
    if not isinstance(env, RestorableEnv):
        return False
    try:
        env.load_state_dict(resume.env_state)
    except Exception:  # e.g. the task changed since the checkpoint: start afresh
        return False
    return True
