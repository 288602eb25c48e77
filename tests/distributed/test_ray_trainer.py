"""Trainer ranks as Ray actors: two FSDP2 ranks (gloo) learn the toy task; a
rank killed mid-run stops the run with a clear message, and --resume
continues it from the last sharded checkpoint on ONE rank."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from sao.app.run import train
from sao.config import load_config
from sao.distributed.trainer import TrainerRankError
from sao.rundir.checkpoint import saved_config
from tests.distributed.processes import own_ray_pids
from tests.train.test_learning import SayATask, _reward_gain, run


@pytest.fixture(autouse=True)
def _shutdown_ray():
    yield
    import ray

    ray.shutdown()


def _kill_rank_after(metrics: Path, step: int) -> threading.Thread:
    def watch() -> None:
        deadline = time.monotonic() + 600  # (Ray starts slowly on a loaded machine)
        while time.monotonic() < deadline:
            if metrics.is_file():
                steps = [json.loads(x).get("step", 0) for x in metrics.read_text().splitlines()]
                pids = own_ray_pids("ray::TrainerRank") if steps and max(steps) >= step else []
                if pids:
                    os.kill(pids[-1], signal.SIGKILL)
                    return
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


RAY = (
    "runtime.backend=ray",
    "runtime.rollout_workers=1",
    "algo=sao",
    "algo.critic_pretrain_steps=2",
    "log.checkpoint_every=6",
    "rollout.request_timeout_s=30",
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_learn_a_dead_rank_stops_and_resume_on_one_rank(
    tmp_path: Path, tiny_policy: Path
) -> None:
    watcher = _kill_rank_after(tmp_path / "run" / "metrics.jsonl", 9)
    with pytest.raises(TrainerRankError, match=r"trainer rank died.*--resume"):
        run(tmp_path, tiny_policy, *RAY, "runtime.trainer_ranks=2")
    watcher.join()
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "step_000006" / "sharded" / ".metadata").is_file()  # written by 2 ranks
    run_dir = tmp_path / "run"
    cfg = saved_config(run_dir, ["runtime.trainer_ranks=1"])
    train(cfg, task=SayATask(), resume=run_dir)
    history = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in history if "train/reward_mean" in r]
    assert steps == list(range(1, 19))  # no step twice, none missing
    first, last = _reward_gain(history)
    assert last > first + 0.2, (first, last)
    assert (run_dir / "final" / "config.json").is_file()


def test_more_ranks_than_groups_is_refused() -> None:
    from sao.config import ConfigError

    with pytest.raises(ConfigError, match="exceeds the groups per batch"):
        load_config(
            overrides=[
                "runtime.backend=ray",
                "runtime.trainer_ranks=4",
                "algo=grpo",
                "algo.group_size=8",
                "train.batch_size=16",
            ]
        )


def test_rank_threads_share_each_nodes_cores_among_its_ranks() -> None:
    from sao.distributed.trainer import rank_threads

    # two ranks on a 2-core node: one thread each; a lone rank: both cores
    assert [rank_threads(0, [("a", 2), ("a", 2)], r) for r in (0, 1)] == [1, 1]
    assert rank_threads(0, [("a", 2)], 0) == 2
    # 3 ranks on a 16-core node (16 // 3 = 5), 1 on an 8-core node (8)
    nodes = [("a", 16), ("a", 16), ("a", 16), ("b", 8)]
    assert [rank_threads(0, nodes, r) for r in range(4)] == [5, 5, 5, 8]
    # more ranks than cores still computes; a configured count wins
    assert rank_threads(0, [("a", 1)] * 3, 2) == 1
    assert rank_threads(3, nodes, 0) == 3


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_critic_on_its_own_rank_learns_and_resumes_colocated(
    tmp_path: Path, tiny_policy: Path
) -> None:
    split = ("runtime.critic_ranks=1", "train.steps=8", "log.checkpoint_every=4")
    history = run(tmp_path, tiny_policy, *RAY, *split)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000004"
    assert (ckpt / "sharded" / ".metadata").is_file()  # the actor group's part
    assert (ckpt / "sharded_critic" / ".metadata").is_file()  # the critic group's
    assert (ckpt / "critic" / "config.json").is_file() and (ckpt / "policy").is_dir()
    assert all("critic/loss" in r and "actor/loss" in r for r in history if "actor/grad_norm" in r)
    run_dir = tmp_path / "run"
    cfg = saved_config(run_dir, ["runtime.critic_ranks=0", "train.steps=16"])
    train(cfg, task=SayATask(), resume=run_dir)  # both models on one rank again
    history = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in history if "train/reward_mean" in r]
    assert steps == list(range(1, 19))
    first, last = _reward_gain(history)
    assert last > first + 0.2, (first, last)


def test_critic_ranks_are_refused_where_they_cannot_work() -> None:
    from sao.config import ConfigError

    with pytest.raises(ConfigError, match=r"critic_ranks > 0 needs runtime\.backend=ray"):
        load_config(overrides=["runtime.critic_ranks=1"])
    with pytest.raises(ConfigError, match="trains no critic"):
        load_config(overrides=["runtime.backend=ray", "runtime.critic_ranks=1", "algo=grpo"])
