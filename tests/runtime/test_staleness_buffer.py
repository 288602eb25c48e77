"""Staleness gate and trajectory buffer: admission, drops, group release."""

from __future__ import annotations

import asyncio

import pytest

from sao.runtime.buffer import TrajectoryBuffer
from sao.runtime.staleness import StalenessGate
from sao.types import Trajectory, Turn


def traj(versions: list[int], *, group: str = "g", reward: float = 1.0) -> Trajectory:
    """Prompt token (version -1) then one action token per entry of ``versions``."""
    n = len(versions)
    return Trajectory(
        prompt_id=group,
        tokens=tuple(range(n + 1)),
        action_mask=(False,) + (True,) * n,
        rollout_logp=(0.0,) + (-0.5,) * n,
        versions=(-1, *versions),
        turns=(Turn(start=1, end=n + 1, obs_end=n + 1),),
        reward=reward,
        finish_reason="stop",
        group_id=group,
    )


def test_admission_capacity_is_lag_plus_one_batches() -> None:
    # B = 2, L = 1: with 0 batches consumed, (0 + 1 + 1) * 2 = 4 episodes may start.
    gate = StalenessGate(max_lag=1, batch_size=2)
    for _ in range(4):
        assert gate.can_start(0)
        gate.start()
    assert not gate.can_start(0)
    # one batch consumed -> capacity (1 + 2) * 2 = 6
    assert gate.can_start(1, n=2) and not gate.can_start(1, n=3)
    # a rejected episode gives its capacity back
    gate.reject()
    assert gate.can_start(0)


def test_sync_is_max_lag_zero() -> None:
    # L = 0, B = 3: exactly one batch per consumed batch.
    gate = StalenessGate(max_lag=0, batch_size=3)
    gate.start(3)
    assert not gate.can_start(0)
    assert gate.can_start(1, n=3) and not gate.can_start(1, n=4)


def test_drop_rule_uses_oldest_action_token() -> None:
    gate = StalenessGate(max_lag=2, batch_size=1)
    t = traj([3, 4, 6])  # oldest action token: version 3
    assert gate.lag(t, 5) == 2 and gate.is_fresh(t, 5)  # 5 - 3 = 2 <= 2
    assert not gate.is_fresh(t, 6)  # 6 - 3 = 3 > 2
    assert gate.dropped == 1 and gate.rejected == 1


def test_bad_gate_arguments() -> None:
    with pytest.raises(ValueError, match="max_lag"):
        StalenessGate(max_lag=-1, batch_size=1)
    with pytest.raises(ValueError, match="batch_size"):
        StalenessGate(max_lag=0, batch_size=0)


def test_groups_are_released_whole_and_fifo() -> None:
    gate = StalenessGate(max_lag=4, batch_size=4)
    buf = TrajectoryBuffer(gate, group_size=2, dynamic_sampling=False)
    buf.add(traj([0], group="a"))
    assert buf.num_ready() == 0  # a group waits for its siblings
    buf.add(traj([0], group="b"))
    buf.add(traj([0], group="b", reward=0.0))
    buf.add(traj([0], group="a", reward=0.0))
    got = asyncio.run(buf.take(4, version=0))
    assert [t.group_id for t in got] == ["b", "b", "a", "a"]


def test_dynamic_sampling_filters_equal_groups() -> None:
    gate = StalenessGate(max_lag=4, batch_size=2)
    buf = TrajectoryBuffer(gate, group_size=2, dynamic_sampling=True)
    buf.add(traj([0], group="a", reward=1.0))
    buf.add(traj([0], group="a", reward=1.0))
    assert buf.num_ready() == 0 and buf.filtered == 2 and gate.rejected == 2


def test_take_drops_stale_groups_and_waits_for_fresh_ones() -> None:
    gate = StalenessGate(max_lag=1, batch_size=1)
    buf = TrajectoryBuffer(gate, group_size=1, dynamic_sampling=False)

    async def scenario() -> list[Trajectory]:
        buf.add(traj([0], group="old"))  # lag 3 - 0 = 3 > 1: dropped
        taker = asyncio.create_task(buf.take(1, version=3))
        await asyncio.sleep(0)
        assert not taker.done()
        buf.add(traj([2, 3], group="new"))  # lag 3 - 2 = 1: kept
        return await taker

    got = asyncio.run(scenario())
    assert [t.group_id for t in got] == ["new"]
    assert gate.dropped == 1


def test_startup_line_states_the_worst_case_lag() -> None:
    gate = StalenessGate(max_lag=4, batch_size=32)
    line = gate.describe(in_flight=32, kv_kept=True)
    assert line.startswith("worst-case policy lag: 4 version(s)")
    assert "= 160 episodes started ahead" in line and "32 running at once" in line  # 5 x 32
    assert "recompute_kv_on_update" in line
    sync = StalenessGate(max_lag=0, batch_size=8).describe(in_flight=32, kv_kept=True)
    assert "lag: 0 version(s)" in sync and "= 8 episodes" in sync and "8 running" in sync
    assert "recompute" not in sync


def test_failed_member_gives_capacity_back_and_drops_its_group() -> None:
    gate = StalenessGate(max_lag=0, batch_size=3)
    buf = TrajectoryBuffer(gate, group_size=3, dynamic_sampling=False)
    gate.start(3)  # one group of 3 fills the capacity (0 + 0 + 1) x 3
    assert not gate.can_start(0, 1)
    buf.add(traj([0], group="a"))
    buf.fail(traj([0], group="a"))  # the second member failed: its slot comes back now
    assert gate.rejected == 1 and gate.can_start(0, 1) and buf.num_ready() == 0
    buf.add(traj([0], group="a"))  # the last member arrives: the group is dropped whole
    assert buf.num_ready() == 0 and buf.failed == 3 and gate.rejected == 3
    assert buf.pending == {} and gate.can_start(0, 3)


def test_failed_single_rollout_is_dropped_at_once() -> None:
    gate = StalenessGate(max_lag=0, batch_size=1)
    buf = TrajectoryBuffer(gate, group_size=1, dynamic_sampling=False)
    gate.start(1)
    buf.fail(traj([0], group="x"))
    assert buf.failed == 1 and gate.rejected == 1 and buf.pending == {}
    buf.add(traj([0], group="y"))
    assert buf.num_ready() == 1
