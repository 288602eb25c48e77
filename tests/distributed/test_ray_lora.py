"""LoRA on Ray trainer ranks: two FSDP2 ranks train a LoRA actor and a LoRA
critic; each update gathers the sharded adapters and sends the rollout workers
the adapted modules' merged weights only, exactly (at max_lag 0 every DIS
ratio is 1); checkpoints hold the adapters in peft's format as a local run
writes them; --resume continues on one rank; final/ holds the merged model
and its adapter."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("ray")

from sao.app.run import train
from sao.models.loading import load_policy
from sao.models.lora import adapter_base, has_lora
from sao.rundir.checkpoint import saved_config
from tests.distributed.test_ray_trainer import RAY
from tests.train.test_learning import SayATask, run
from tests.train.test_lora_run import LORA, _learned


@pytest.fixture(autouse=True)
def _shutdown_ray():
    yield
    import ray

    ray.shutdown()


def _exact(history: list[dict[str, float]]) -> int:
    """Every actor step's DIS ratios within 1e-3 of 1; returns how many steps."""
    ratios = [(r["dis/ratio_min"], r["dis/ratio_max"]) for r in history if "dis/ratio_max" in r]
    for lo, hi in ratios:
        assert abs(math.log(lo)) < 1e-3 and abs(math.log(hi)) < 1e-3, ratios
    return len(ratios)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_on_two_sharded_ranks_is_exact_learns_and_resumes_on_one(
    tmp_path: Path, tiny_policy: Path
) -> None:
    sync = ("runtime.max_lag=0", "train.steps=8", "log.checkpoint_every=4")
    first = run(tmp_path, tiny_policy, *RAY, *LORA, *sync, "runtime.trainer_ranks=2")
    assert _exact(first) == 8
    ckpt = tmp_path / "run" / "checkpoints" / "step_000004"
    assert (ckpt / "sharded" / ".metadata").is_file()  # written by 2 ranks
    assert (ckpt / "policy" / "adapter_model.safetensors").is_file()
    assert not (ckpt / "policy" / "model.safetensors").exists()  # the base is not copied
    assert adapter_base(ckpt / "policy") == str(tiny_policy)
    assert (ckpt / "critic" / "adapter" / "trained_base.safetensors").is_file()

    run_dir = tmp_path / "run"
    cfg = saved_config(run_dir, ["runtime.trainer_ranks=1", "train.steps=16"])
    train(cfg, task=SayATask(), resume=run_dir)
    history = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in history if "train/reward_mean" in r]
    assert steps == list(range(1, 19))  # no step twice, none missing
    assert _exact(history) == 16
    _learned(tmp_path, tiny_policy, history)
    final = run_dir / "final"
    assert adapter_base(final / "adapter") == str(tiny_policy)
    assert not has_lora(load_policy(final))  # a plain Hugging Face model, merged
