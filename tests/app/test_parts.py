"""What a run is built from: the driver of Ray trainer ranks holds no weights."""

from __future__ import annotations

from pathlib import Path

from sao.app.parts import build_parts
from sao.config import load_config


def test_the_driver_of_ray_trainer_ranks_loads_no_weights(tiny_policy: Path) -> None:
    cfg = load_config(overrides=[f"model.path={tiny_policy}", "algo=sao", "runtime.backend=ray"])
    shell = build_parts(cfg, models=False)
    full = build_parts(cfg)
    assert shell.trainer is None and shell.critic is None
    assert {p.device.type for p in shell.policy.parameters()} == {"meta"}
    # the same names, shapes and dtypes as the loaded policy: enough to describe a broadcast
    got = {k: (v.shape, v.dtype) for k, v in shell.policy.state_dict().items()}
    want = {k: (v.shape, v.dtype) for k, v in full.policy.state_dict().items()}
    assert got == want
    assert shell.policy.config.to_dict() == full.policy.config.to_dict()
    assert full.trainer is not None and full.critic is not None
