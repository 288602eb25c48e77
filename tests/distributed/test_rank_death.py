"""A dead trainer rank stops the run with TrainerRankError whichever error
reaches the driver first: the survivor's collective fails as soon as the dead
peer's socket closes, often before Ray reports the death (seen under
``pytest -n 2``: a gloo error from the live rank surfaced instead)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

import sao.distributed.trainer as trainer_mod
from sao.distributed.trainer import RayTrainerGroup, TrainerRankError


class ActorDied(Exception):
    """Stands in for ray.exceptions.RayActorError."""


def group() -> RayTrainerGroup:
    ray = SimpleNamespace(exceptions=SimpleNamespace(RayActorError=ActorDied))
    return RayTrainerGroup(ray, ranks=[])


async def fails(err: Exception, after_s: float = 0.0) -> None:
    await asyncio.sleep(after_s)
    raise err


async def returns(value: object, after_s: float = 0.0) -> object:
    await asyncio.sleep(after_s)
    return value


def test_the_survivors_collective_error_first_still_says_a_rank_died() -> None:
    gloo = RuntimeError("[gloo] Connection reset by peer")
    calls = [fails(gloo), fails(ActorDied("rank 1 was killed"), after_s=0.05)]
    with pytest.raises(TrainerRankError, match=r"died during step \(ActorDied\).*--resume") as e:
        asyncio.run(group()._wait(calls, "step"))
    assert isinstance(e.value.__cause__, ActorDied)


def test_an_error_with_every_rank_alive_is_raised_as_it_is() -> None:
    bad = ValueError("bad batch")
    with pytest.raises(ValueError, match="bad batch"):
        asyncio.run(group()._wait([fails(bad), returns(1, after_s=0.05)], "step"))


def test_the_wait_for_a_late_death_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainer_mod, "DEATH_GRACE_S", 0.05)
    hung = returns(1, after_s=60)  # a rank stuck in its collective
    with pytest.raises(RuntimeError, match="gloo"):
        asyncio.run(group()._wait([fails(RuntimeError("gloo")), hung], "step"))


def test_a_death_of_the_rank_not_waited_for_counts_after_a_failure() -> None:
    # weights(): rank 0's gathered state stays in the object store; the others
    # are awaited, and their failure looks at rank 0 too
    calls = [fails(RuntimeError("gloo"))]
    with pytest.raises(TrainerRankError, match="the weights' gathering"):
        asyncio.run(group()._wait(calls, "the weights' gathering", also=fails(ActorDied())))
    unseen = fails(ActorDied())  # on success it is never looked at
    assert asyncio.run(group()._wait([returns(2)], "x", also=unseen)) == [2]
    unseen.close()
