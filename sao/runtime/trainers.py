"""Where the trainer runs: in this process (:class:`LocalTrainer`) or as a
group of Ray actors (:class:`~sao.distributed.trainer.RayTrainerGroup`).
``sao train`` talks to either through the same few calls, so the run loop
has no backend branches: train a batch, hand out the weights, score
trajectories for the log-probability check, write the models into a
checkpoint, export the final policy."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sao.models.cache import atomic_dir
from sao.models.lora import export_policy, published_state, save_policy
from sao.rollout.check import LogprobReport, score_trajectories
from sao.rollout.openmp import releasing
from sao.runtime.memory import give_back_freed
from sao.types import SamplingParams, Trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from sao.models.value import ValueModel
    from sao.train.trainer import Trainer

__all__ = ["LocalModels", "LocalTrainer", "TrainerHandle"]


class TrainerHandle(Protocol):
    async def step(self, batch: list[Trajectory], train_actor: bool) -> dict[str, float]: ...

    async def weights(self) -> Any:
        """The policy's full state dict (local) or an object-store reference to it (Ray)."""
        ...

    async def score(
        self, trajectories: list[Trajectory], sampling: SamplingParams, engine: Any = None
    ) -> LogprobReport: ...

    async def turn_values(self, trajectories: list[Trajectory]) -> list[list[float]]:
        """The critic's value at the start of each turn of each trajectory (NaN
        without a critic; :func:`~sao.train.critic_fit.turn_values`)."""
        ...

    async def save_models(self, directory: Path) -> None:
        """Write ``policy/`` and ``critic/`` (Hugging Face) and the optimizer
        state into a checkpoint directory being built."""
        ...

    def trainer_state(self) -> dict[str, object]:
        """What goes into the checkpoint's ``trainer.pt`` beside the RNG state."""
        ...

    async def export(self, directory: Path) -> None:
        """The trained policy and tokenizer in Hugging Face format."""
        ...

    def close(self) -> None: ...


class LocalModels(Protocol):
    """What a :class:`LocalTrainer` trains and writes (the composition root's
    :class:`~sao.app.parts.Parts` has these fields)."""

    @property
    def policy(self) -> PreTrainedModel: ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def critic(self) -> ValueModel | None: ...

    @property
    def trainer(self) -> Trainer | None: ...


class LocalTrainer:
    """The trainer of :class:`~sao.app.parts.Parts` (any :class:`LocalModels`),
    in this process. ``release``: give the allocator's freed pages back to the kernel
    after each step (``train.release_memory``, :func:`~sao.runtime.memory.give_back_freed`)."""

    def __init__(self, parts: LocalModels, *, release: bool = True) -> None:
        assert parts.trainer is not None, "a local trainer needs the parts' trainer"
        self.p, self.trainer, self.release = parts, parts.trainer, release

    async def step(self, batch: list[Trajectory], train_actor: bool) -> dict[str, float]:
        stats = await asyncio.to_thread(releasing(self._step), batch, train_actor)
        return {k: float(v) for k, v in stats.items()}

    def _step(self, batch: list[Trajectory], train_actor: bool) -> dict[str, Any]:
        stats = self.trainer.step(batch, train_actor=train_actor)
        if self.release:
            give_back_freed()
        return stats

    async def weights(self) -> Any:
        return published_state(self.p.policy)

    async def score(
        self, trajectories: list[Trajectory], sampling: SamplingParams, engine: Any = None
    ) -> LogprobReport:
        return await asyncio.to_thread(
            releasing(score_trajectories),
            self.p.policy,
            self.p.tokenizer,
            trajectories,
            sampling,
            engine=engine,
        )

    async def turn_values(self, trajectories: list[Trajectory]) -> list[list[float]]:
        from sao.train.critic_fit import turn_values

        return await asyncio.to_thread(releasing(turn_values), self.trainer, trajectories)

    async def save_models(self, directory: Path) -> None:
        def write() -> None:
            save_policy(self.p.policy, directory / "policy")
            if self.p.critic is not None:
                self.p.critic.save_pretrained(directory / "critic")

        await asyncio.to_thread(releasing(write))

    def trainer_state(self) -> dict[str, object]:
        return self.trainer.state_dict()

    async def export(self, directory: Path) -> None:
        def write() -> None:
            with atomic_dir(directory) as tmp:
                export_policy(self.p.policy, tmp)
                self.p.tokenizer.save_pretrained(tmp)

        await asyncio.to_thread(releasing(write))

    def close(self) -> None:
        pass
