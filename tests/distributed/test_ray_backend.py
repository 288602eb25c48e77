"""The Ray backend: rollout workers as Ray actors on a local cluster learn like
the local backend, and a worker killed mid-run is replaced."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray")

from sao.rollout.embedded.engine import TorchEngine
from tests.distributed.processes import own_ray_pids
from tests.train.test_learning import _reward_gain, run


@pytest.fixture(autouse=True)
def _shutdown_ray():
    yield
    import ray

    ray.shutdown()


def _worker_pids() -> list[int]:
    return own_ray_pids("ray::RolloutWorker")


def _kill_one_worker_after(metrics: Path, step: int, killed: list[int]) -> threading.Thread:
    """SIGKILL one rollout worker once ``metrics`` shows ``step``; records the
    step at which it did so in ``killed``."""

    def watch() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if metrics.is_file():
                steps = [json.loads(x).get("step", 0) for x in metrics.read_text().splitlines()]
                pids = _worker_pids()
                if steps and max(steps) >= step and pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed.append(max(steps))
                    return
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_rollout_workers_learn_and_survive_a_dead_worker(
    tmp_path: Path, tiny_policy: Path
) -> None:
    killed: list[int] = []
    watcher = _kill_one_worker_after(tmp_path / "run" / "metrics.jsonl", 4, killed)
    history = run(
        tmp_path,
        tiny_policy,
        "algo=sao",
        "algo.critic_pretrain_steps=2",
        "train.steps=24",  # long enough that the kill lands mid-run on a busy machine
        "runtime.backend=ray",
        "runtime.rollout_workers=2",
    )
    watcher.join()
    assert killed and killed[0] < 20, f"the worker was killed at step {killed} (run: 26 steps)"
    first, last = _reward_gain(history)
    assert last > first + 0.2, (first, last)
    assert max(r["step"] for r in history) == 26  # 2 warm-up + 24 actor steps
    assert max(r.get("workers/replaced", 0) for r in history) >= 1
    assert [r["version"] for r in history if "version" in r][-1] == 24
    # the estimate printed before training counts the driver, Ray's own processes,
    # the trainer rank and both workers: the measured peak stays within 1.3x of it
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["memory/peak_gib"] <= 1.3 * summary["memory/expected_peak_gib"], summary


def test_too_small_a_cluster_says_what_is_missing(tmp_path: Path, tiny_policy: Path) -> None:
    from sao.config import ConfigError

    with pytest.raises(ConfigError, match=r"CPU: asks for 8, the cluster has \d"):
        run(
            tmp_path,
            tiny_policy,
            "runtime.backend=ray",
            "runtime.rollout_workers=8",
            "runtime.cpus_per_worker=1",
            "train.memory_check=false",  # (the cluster's check, whatever memory is free)
        )


def test_ray_backend_without_ray_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from sao.config import ConfigError
    from sao.distributed.backend import _ray

    real_import = builtins.__import__

    def no_ray(name: str, *args: object, **kwargs: object) -> object:
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    with monkeypatch.context() as patched:  # undone before the fixtures' teardown imports ray
        patched.setattr(builtins, "__import__", no_ray)
        with pytest.raises(ConfigError, match=r"pip install 'sao\[ray\]'"):
            _ray()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_trainer_rank_broadcasts_weights_to_the_servers(
    tmp_path: Path, tiny_policy: Path
) -> None:
    """Two rollout workers, each driving one launched `sao serve`; every version
    goes from the trainer's rank 0 to both servers over one gloo group, never
    through the filesystem, and the sampled reward rises (the servers'
    weights change: nothing else can raise it)."""
    history = run(
        tmp_path,
        tiny_policy,
        "algo=sao",
        "algo.critic_pretrain_steps=2",
        "runtime.backend=ray",
        "runtime.rollout_workers=2",
        "rollout.engine=http",
        "rollout.launch=2",
        "rollout.weight_transfer=broadcast",
    )
    first, last = _reward_gain(history)
    assert last > first + 0.2, (first, last)
    assert [r["version"] for r in history if "version" in r][-1] == 16
    assert all(r["publish/sync_s"] > 0 for r in history if "publish/sync_s" in r)
    assert not (tmp_path / "run" / "weights").exists()  # nothing went through the filesystem


@pytest.mark.parametrize(
    ("sets", "dtype"),
    [
        ((), torch.float32),
        (("rollout.engine_dtype=bfloat16",), torch.bfloat16),
        (("model.dtype=bfloat16",), torch.bfloat16),
    ],
)
def test_a_rollout_worker_engine_takes_the_configured_dtypes(
    tiny_policy: Path, sets: tuple[str, ...], dtype: torch.dtype
) -> None:
    """A Ray worker's embedded engine copies the weights in the dtype a local run's
    engine would: ``rollout.engine_dtype``, else ``model.dtype`` (built here in this
    process, as the worker's actor builds it)."""
    from sao.app.distributed import build_rollout_worker
    from sao.config import load_config

    cfg = load_config(overrides=[f"model.path={tiny_policy}", "runtime.backend=ray", *sets])

    async def built() -> torch.dtype:
        _, engine = await build_rollout_worker(cfg, str(tiny_policy), None, [], 0)
        try:
            assert isinstance(engine, TorchEngine)
            return engine.dtype
        finally:
            await engine.aclose()

    assert asyncio.run(built()) == dtype
