"""Checkpoints that a crash cannot corrupt: everything is written into a
temporary directory that is renamed into place, and ``latest`` is replaced
atomically afterwards.

A checkpoint holds the actor and critic (Hugging Face format), both optimizers
and the LR schedule, RNG states, step and version, the running-mean state,
the staleness counters, the buffer's finished trajectories, and where the
prompt stream stands (prompts that were in flight are started again on
resume, so no finished trajectory is counted twice or lost).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from sao.models.value import ValueModel
from sao.types import SamplingParams, Trajectory, Turn


def trajectory_to_dict(t: Trajectory) -> dict[str, Any]:
    """A JSON-serialisable form of a trajectory."""
    return asdict(t)


def trajectory_from_dict(d: dict[str, Any]) -> Trajectory:
    """Inverse of :func:`trajectory_to_dict`."""
    d = dict(d)
    d["turns"] = tuple(Turn(**x) for x in d["turns"])
    s = dict(d["sampling"])
    s["stop_token_ids"] = tuple(s["stop_token_ids"])
    s["stop_strings"] = tuple(s["stop_strings"])
    d["sampling"] = SamplingParams(**s)
    for key in ("tokens", "action_mask", "rollout_logp", "versions"):
        d[key] = tuple(d[key])
    return Trajectory(**d)


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    *,
    policy: PreTrainedModel,
    critic: ValueModel | None,
    trainer_state: dict[str, object],
    state: dict[str, Any],
    trajectories: list[Trajectory],
) -> Path:
    """Write checkpoint ``step`` under ``ckpt_root`` atomically; returns its path."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp_step_{step:06d}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    policy.save_pretrained(tmp / "policy")
    if critic is not None:
        critic.save_pretrained(tmp / "critic")
    torch.save({"trainer": trainer_state, "rng": rng_state()}, tmp / "trainer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2))
    with (tmp / "trajectories.jsonl").open("w") as f:
        for t in trajectories:
            f.write(json.dumps(trajectory_to_dict(t)) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = ckpt_root / ".latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, ckpt_root / "latest")
    return final


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    pointer = ckpt_root / "latest"
    if not pointer.is_file():
        return None
    path = ckpt_root / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


def load_state(path: Path) -> tuple[dict[str, Any], dict[str, Any], list[Trajectory]]:
    """``(state.json, trainer.pt contents, buffered trajectories)`` of a checkpoint."""
    state = json.loads((path / "state.json").read_text())
    blob = torch.load(path / "trainer.pt", weights_only=False)
    lines = (path / "trajectories.jsonl").read_text().splitlines()
    return state, blob, [trajectory_from_dict(json.loads(x)) for x in lines if x]
