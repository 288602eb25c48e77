"""Training an agent you wrote: an :class:`AgentTask` is your agent (an async
function or a command line) and its problems; :class:`AgentRunner` plays its
episodes against the :class:`~sao.agents.endpoint.AgentEndpoint`.

An agent function ``async def run(client, task) -> float`` gets an
``openai.AsyncOpenAI`` client whose ``base_url`` names the episode, and one
problem of the train or eval list; it returns the episode's reward. A
command (``AgentTask.command``) runs once per episode with
``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` (the episode id) and ``SAO_TASK``
(the problem as JSON) in its environment, and prints the reward as the last
line of its output. An agent that raises, exits non-zero, prints no number
or outlives ``timeout_s`` ends its episode as a failure with the reason
(``error`` or ``timeout``), never the run.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sao.agents.endpoint import AgentEndpoint
from sao.agents.export import AgentExport, export_calls
from sao.envs.base import Split
from sao.rollout.envcall import describe_error
from sao.rollout.resume import EpisodeResume
from sao.types import SamplingParams, Trajectory, failed_trajectory

__all__ = ["AgentFn", "AgentRunner", "AgentTask"]

AgentFn = Callable[[Any, Any], Awaitable[float]]
"""``async def run(client: openai.AsyncOpenAI, task) -> reward``."""


@dataclass
class AgentTask:
    """Your agent and its problems (any JSON-serialisable items for a command)."""

    train: Sequence[Any]
    eval: Sequence[Any]
    run: AgentFn | None = None
    command: Sequence[str] | None = None
    timeout_s: float = 600.0
    name: str = "agent"

    def __post_init__(self) -> None:
        if (self.run is None) == (self.command is None):
            raise ValueError("AgentTask needs exactly one of run (an async function) or command")
        if not self.train:
            raise ValueError("AgentTask.train is empty: give it at least one problem")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"AgentTask.timeout_s must be > 0 seconds, got {self.timeout_s!r}")

    @property
    def eval_size(self) -> int:
        return len(self.eval)

    def problem(self, split: Split, index: int) -> Any:
        items = self.train if split == "train" else self.eval
        return items[index % len(items)]


class _AgentFailure(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


@dataclass
class AgentRunner:
    """An :class:`~sao.runtime.runner.EpisodeRunner` over an agent and the endpoint."""

    task: AgentTask
    endpoint: AgentEndpoint
    export: AgentExport = "concat"

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
    ) -> Trajectory | list[Trajectory]:
        """Play one episode; its calls as one trajectory or one per call."""
        eid = f"{prompt_id.replace('/', '-')}-{seed}"
        ep = self.endpoint.open(eid, sampling)
        try:
            reward = await self._play(eid, self.task.problem(split, index))
        except _AgentFailure as fail:
            return failed_trajectory(prompt_id, group_id, sampling, fail.reason, fail.message)  # type: ignore[arg-type]
        finally:
            self.endpoint.close_episode(eid)
        if not ep.calls:
            why = "the agent finished without calling the model"
            return failed_trajectory(prompt_id, group_id, sampling, "error", why)
        out = export_calls(
            ep.calls, reward, mode=self.export, prompt_id=prompt_id, group_id=group_id,
            sampling=sampling,
        )  # fmt: skip
        return out[0] if len(out) == 1 else out

    async def _play(self, eid: str, problem: Any) -> float:
        base = f"{self.endpoint.url}/episodes/{eid}/v1"
        work = (
            self._call(base, eid, problem) if self.task.run else self._command(base, eid, problem)
        )
        try:
            value = await asyncio.wait_for(work, self.task.timeout_s)
        except TimeoutError:
            raise _AgentFailure(
                "timeout",
                f"the agent did not finish within AgentTask.timeout_s={self.task.timeout_s} s",
            ) from None
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise _AgentFailure("error", f"the agent returned {value!r}, not a finite reward")
        return float(value)

    async def _call(self, base: str, eid: str, problem: Any) -> object:
        from openai import AsyncOpenAI

        assert self.task.run is not None
        async with AsyncOpenAI(base_url=base, api_key=eid, max_retries=0) as client:
            try:
                return await self.task.run(client, problem)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                raise _AgentFailure("error", f"the agent raised {describe_error(err)}") from err

    async def _command(self, base: str, eid: str, problem: Any) -> object:
        assert self.task.command is not None
        env = os.environ | {"OPENAI_BASE_URL": base, "OPENAI_API_KEY": eid}
        env["SAO_TASK"] = json.dumps(problem)
        proc = await asyncio.create_subprocess_exec(
            *self.task.command, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        try:
            out, _ = await proc.communicate()
        except asyncio.CancelledError:
            proc.kill()
            raise
        text = out.decode(errors="replace").strip()
        last = text.splitlines()[-1] if text else ""
        if proc.returncode != 0:
            raise _AgentFailure("error", f"the agent exited with {proc.returncode}: {text[-300:]}")
        try:
            return float(last)
        except ValueError:
            raise _AgentFailure(
                "error", f"the agent's last line of output is not a reward: {last[:100]!r}"
            ) from None

    def set_train_step(self, step: int) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    async def take_resumes(self, keys: list[str]) -> dict[str, EpisodeResume]:
        return {}  # agent episodes restart from scratch after a checkpoint
