"""The NaN/inf guard with 2 FSDP2 ranks (gloo, spawned on the CPU): a NaN that
only one rank sees in its own rows still skips the update on every rank (the
ranks' counts are summed before the decision), an overflowing AdamW update is
skipped on every rank, both ranks count the same bad steps, and both stop at
the same step instead of one waiting for the other."""

from __future__ import annotations

import os
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor

from sao.train.guard import NonFiniteError
from sao.train.sharded import init_trainer_group
from sao.train.trainer import Trainer
from sao.types import Trajectory
from tests.train.sharded_worker import make_batch, make_trainer

NAN = float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local(model: nn.Module | None) -> list[torch.Tensor]:
    """This rank's shards of ``model``'s parameters, cloned."""
    assert model is not None
    return [
        (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()
    ]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def nan_row(batch: list[Trajectory], row: int) -> list[Trajectory]:
    """``batch`` with a NaN rollout log-probability on one action token of ``row``."""
    t = batch[row]
    first = t.action_mask.index(True)
    logp = tuple(NAN if i == first else v for i, v in enumerate(t.rollout_logp))
    return [*batch[:row], replace(t, rollout_logp=logp), *batch[row + 1 :]]


def scenario(trainer: Trainer, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    trainer.step(make_batch(1, 16, 1))
    # A: one row's rollout log-prob is NaN: only the rank that trains the row sees it
    actor, critic = local(trainer.policy), local(trainer.critic)
    trainer.step(nan_row(make_batch(2, 16, 1), 5))
    out["A_actor_kept"] = same(local(trainer.policy), actor)
    out["A_critic_moved"] = not same(local(trainer.critic), critic)
    # B: rank 1's critic forward is NaN in its updates; the values for GAE come from the
    # first update's forward, so the advantages would be NaN too: nothing trains, anywhere
    assert trainer.critic is not None
    hook = trainer.critic.value_head.register_forward_hook(
        lambda m, a, o: o * NAN if rank == 1 and torch.is_grad_enabled() else o
    )
    actor, critic = local(trainer.policy), local(trainer.critic)
    trainer.step(make_batch(3, 16, 1))
    hook.remove()
    out["B_critic_kept"] = same(local(trainer.critic), critic)
    out["B_actor_kept"] = same(local(trainer.policy), actor)
    trainer.step(make_batch(4, 16, 1))  # a good step: none in a row
    # D: an actor LR whose AdamW step overflows: the bound sends every rank to the
    # exact prediction (one more collective), and every rank skips the update
    group = trainer.actor_optim.param_groups[0]
    lr, group["lr"] = group["lr"], 1e39
    actor = local(trainer.policy)
    trainer.step(make_batch(5, 16, 1))
    group["lr"] = lr
    out["D_actor_kept"] = same(local(trainer.policy), actor)
    out["D_why"] = trainer.bad.in_a_row == 1 and trainer.bad.found.get("actor", "")
    out["skipped"] = dict(trainer.bad.per_model)
    trainer.step(make_batch(6, 16, 1))
    # C: the third bad step in a row stops the run, on both ranks
    out["stopped_at"] = None
    for i in range(3):
        try:
            trainer.step(nan_row(make_batch(7 + i, 16, 1), 5))
        except NonFiniteError as e:
            out["stopped_at"], out["message"] = i, str(e)
            break
    return out


def rank_main(rank: int, world: int, port: int, tmp: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    ranks = init_trainer_group("cpu", timeout_s=120)  # a mismatched collective fails, not hangs
    try:
        torch.save(scenario(make_trainer("sao", ranks), rank), Path(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_skip_count_and_stop_together(tmp_path: Path) -> None:
    mp.spawn(rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for r in (r0, r1):
        assert r["A_actor_kept"] and r["A_critic_moved"]
        assert r["B_critic_kept"] and r["B_actor_kept"]
        assert r["D_actor_kept"] and str(r["D_why"]).startswith("update")
        assert r["skipped"] == {"actor": 2, "critic": 1}
        assert r["stopped_at"] == 2 and "train.max_bad_steps=3" in r["message"]
    assert "actor: NaN/inf rollout log-probabilities" in r0["message"] + r1["message"]
