"""Just-in-time admission: the lead from measured step and episode times (times
passed in, so the arithmetic is exact), and the orchestrator using it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sao.rollout.resume import EpisodeResume
from sao.runtime.admission import JustInTime
from sao.runtime.buffer import TrajectoryBuffer
from sao.runtime.orchestrator import Orchestrator
from sao.runtime.staleness import StalenessGate
from sao.types import SamplingParams, Trajectory, Turn


def test_capacity_counts_the_batch_in_training_plus_ahead() -> None:
    # B = 4, ahead 1: with s = 2 consumed, batch 3 (training or asked for) and one
    # more: (2 + 1) * 4 + 1 * 4 = 16 episodes
    jit = JustInTime(max_ahead=4)
    assert jit.ahead == 1.0 and jit.capacity(2, 4) == 16
    # ahead 0.3 of a batch of 4: ceil(1.2) = 2 more than the batch in training
    jit.ahead = 0.3
    assert jit.capacity(2, 4) == 12 + 2
    # the static rule is ahead = max_lag: (s + L + 1) * B
    assert JustInTime(max_ahead=4, ahead=4.0).capacity(2, 4) == (2 + 4 + 1) * 4


def test_a_late_batch_raises_ahead_and_a_surplus_lowers_it() -> None:
    jit = JustInTime(max_ahead=3)
    jit.took(10.0, waited_s=0.0, surplus=0, batch_size=8)  # no step time yet: never late
    jit.ask(12.0)  # busy 2 s
    jit.took(13.0, waited_s=1.0, surplus=0, batch_size=8)  # 1 s > 5% of 2 s: late
    assert jit.waits == 1 and jit.ahead == 2.0
    jit.ask(15.0)
    jit.took(15.05, waited_s=0.05, surplus=16, batch_size=8)  # 0.05 <= 0.1: on time
    # 16 ready beside the batch = 2 batches; gives back 0.25 * 2 = 0.5
    assert jit.waits == 1 and jit.ahead == 1.5
    for _ in range(3):  # late three times: capped at max_lag = 3
        jit.ask(20.0)
        jit.took(22.0, waited_s=2.0, surplus=0, batch_size=8)
    assert jit.ahead == 3.0 and jit.waits == 4
    jit.took(30.0, waited_s=0.0, surplus=800, batch_size=8)  # never below 0
    assert jit.ahead == 0.0


def test_estimates_are_the_median_step_and_a_duration_quantile() -> None:
    jit = JustInTime(max_ahead=4, quantile=0.9)
    assert jit.step_s() is None and jit.episode_s() is None
    for s in [5.0, 1.0, 2.0, 4.0, 3.0, 6.0, 7.0, 8.0, 9.0, 10.0]:
        jit.episode_done(s)
    assert jit.episode_s() == 9.0  # ceil(0.9 * 10) = 9th smallest
    for took, asked in [(0.0, 1.0), (1.0, 4.0), (4.0, 6.0)]:  # busy 1, 3, 2
        jit.took(took, waited_s=0.0, surplus=0, batch_size=1)
        jit.ask(asked)
    assert jit.step_s() == 2.0


def test_sync_and_bad_arguments() -> None:
    assert JustInTime(max_ahead=0).ahead == 0.0  # max_lag = 0: synchronous, as static
    assert JustInTime(max_ahead=0).capacity(5, 3) == 18
    with pytest.raises(ValueError, match="max_ahead"):
        JustInTime(-1)


def test_gate_never_exceeds_its_bound_whatever_the_capacity() -> None:
    gate = StalenessGate(max_lag=1, batch_size=2)
    gate.start(4)  # (0 + 1 + 1) * 2 = 4: full at lag 1
    assert not gate.can_start(0, capacity=100)
    assert not gate.can_start(1, capacity=4)  # the smaller limit binds: 4 < 4 + 1
    assert gate.can_start(1, n=2, capacity=6)  # 6 = 4 + 2, within (1 + 2) * 2


# ---------------------------------------------------------------- in the orchestrator


class _Instant:
    """Episodes that finish at once with one action token at the engine's version."""

    eval_size = 0

    def __init__(self) -> None:
        self.version = 0

    async def run(self, split: str, index: int, **kw: Any) -> Trajectory:
        await asyncio.sleep(0.001)
        v = self.version
        return Trajectory(
            prompt_id=kw["prompt_id"],
            tokens=(0, 1),
            action_mask=(False, True),
            rollout_logp=(0.0, -0.5),
            versions=(-1, v),
            turns=(Turn(start=1, end=2, obs_end=2),),
            reward=1.0,
            finish_reason="stop",
            group_id=kw["group_id"],
        )

    async def take_resumes(self, keys: list[str]) -> dict[str, EpisodeResume]:
        return {}

    def set_train_step(self, step: int) -> None:
        self.version = step

    def metrics(self) -> dict[str, float]:
        return {}


def _orchestrator(
    runner: Any, gate: StalenessGate, *, in_flight: int, group: int = 1, **kw: Any
) -> Orchestrator:
    """An orchestrator over ``runner``; groups of ``group`` are filtered when all
    equal (dynamic sampling) if ``group > 1``."""
    buffer = TrajectoryBuffer(gate, group_size=group, dynamic_sampling=group > 1)
    return Orchestrator(
        runner, SamplingParams(), gate=gate, buffer=buffer, in_flight=in_flight,
        group_size=group, seed=0, **kw,
    )  # fmt: skip


def _staleness(admission: JustInTime | None) -> list[float]:
    """Staleness per step of 12 steps of a trainer much slower than its episodes."""
    gate = StalenessGate(max_lag=3, batch_size=4)
    orch = _orchestrator(_Instant(), gate, in_flight=64, admission=admission)
    seen: list[float] = []

    async def step(batch: list[Trajectory], train_actor: bool) -> dict[str, float]:
        await asyncio.sleep(0.1)  # 100x an episode
        return {}

    async def publish(version: int) -> float:
        return 0.0

    async def on_step(step: int, m: dict[str, float]) -> None:
        seen.append(m["staleness/mean"])

    asyncio.run(orch.train(12, 4, step, publish, on_step=on_step))
    return seen


def test_jit_trains_fresher_data_than_the_static_rule() -> None:
    static = _staleness(None)
    jit = _staleness(JustInTime(3))
    # static: rollouts run max_lag + 1 = 4 batches ahead, so from step 5 on every
    # batch was sampled 3 versions back; jit keeps one batch ahead: 1 version (more
    # for a few steps after a batch came late, e.g. on a loaded machine)
    assert static[6:] == [3.0] * 6
    assert max(jit) <= 3.0 and sum(jit[6:]) / 6 <= 2.0


# ---------------------------------------------------------------- fixed staleness (lockstep)


class _Tokens(_Instant):
    """Episodes of three action tokens, each sampled at the engine's version at
    that moment (an in-flight update would show as mixed versions); every fourth
    prompt's group gets equal rewards (dropped by dynamic sampling)."""

    def __init__(self, token_s: float) -> None:
        super().__init__()
        self.token_s = token_s

    async def run(self, split: str, index: int, **kw: Any) -> Trajectory:
        versions = []
        for _ in range(3):
            await asyncio.sleep(self.token_s)
            versions.append(self.version)
        member = kw["seed"] % 131  # _seed(index, member) = seed * 1_000_003 + index * 131 + member
        return Trajectory(
            prompt_id=kw["prompt_id"],
            tokens=(0, 1, 2, 3),
            action_mask=(False, True, True, True),
            rollout_logp=(0.0, -0.5, -0.5, -0.5),
            versions=(-1, *versions),
            turns=(Turn(start=1, end=4, obs_end=4),),
            reward=0.0 if index % 4 == 3 else float(member % 2),
            finish_reason="stop",
            group_id=kw["group_id"],
        )


def _lockstep(
    *, step_s: float, token_s: float, max_lag: int, group: int = 1, steps: int = 10
) -> tuple[list[tuple[float, float]], list[list[int]]]:
    """(min, max) staleness per step and each batch's token versions, in lockstep."""
    gate = StalenessGate(max_lag=max_lag, batch_size=4)
    runner = _Tokens(token_s)
    # in_flight 6: fewer than the episodes admitted ahead, so they queue
    orch = _orchestrator(runner, gate, in_flight=6, group=group, lockstep=True)
    seen: list[tuple[float, float]] = []
    batches: list[list[int]] = []

    async def step(batch: list[Trajectory], train_actor: bool) -> dict[str, float]:
        batches.append(sorted({v for t in batch for v in t.versions if v >= 0}))
        await asyncio.sleep(step_s)
        return {}

    async def publish(version: int) -> float:
        await asyncio.sleep(0.01)  # an episode started now would sample old weights
        return 0.01

    async def on_step(step: int, m: dict[str, float]) -> None:
        seen.append((m["staleness/min"], m["staleness/max"]))

    asyncio.run(orch.train(steps, 4, step, publish, on_step=on_step))
    return seen, batches


@pytest.mark.parametrize("step_s, token_s", [(0.05, 0.001), (0.001, 0.01)])
def test_fixed_staleness_is_exact_whether_trainer_or_rollouts_are_slower(
    step_s: float, token_s: float
) -> None:
    seen, batches = _lockstep(step_s=step_s, token_s=token_s, max_lag=3)
    # batches 0-3 were sampled at version 0, taken at versions 0, 1, 2, 3; from
    # then on batch s was sampled at version s - 3: staleness exactly 3
    assert seen == [(0, 0), (1, 1), (2, 2), (3, 3)] + [(3, 3)] * 6
    # one version per batch: no episode spanned an update
    assert batches == [[0], [0], [0], [0], [1], [2], [3], [4], [5], [6]]


def test_fixed_staleness_zero_is_synchronous() -> None:
    seen, batches = _lockstep(step_s=0.001, token_s=0.001, max_lag=0, steps=5)
    assert seen == [(0, 0)] * 5 and batches == [[0], [1], [2], [3], [4]]


def test_fixed_staleness_waits_for_groups_refilled_after_a_filtered_one() -> None:
    # groups of 2, every fourth prompt's group filtered (equal rewards): its
    # capacity is given back and refilled before the trainer publishes
    seen, batches = _lockstep(step_s=0.005, token_s=0.002, max_lag=2, group=2, steps=8)
    assert seen == [(0, 0), (1, 1)] + [(2, 2)] * 6
    assert batches == [[0], [0], [0], [1], [2], [3], [4], [5]]


def test_lockstep_refuses_a_just_in_time_controller() -> None:
    gate = StalenessGate(max_lag=1, batch_size=2)
    with pytest.raises(ValueError, match="lockstep"):
        _orchestrator(_Instant(), gate, in_flight=4, admission=JustInTime(1), lockstep=True)
