"""Checkpoints that a crash cannot corrupt: everything is written into a
temporary directory that is renamed into place, and ``latest`` is replaced
atomically afterwards.

A checkpoint holds the actor and critic (Hugging Face format), both optimizers
and the LR schedule, RNG states, step and version, the running-mean state,
the staleness counters, the buffer's finished trajectories, and where the
prompt stream stands (prompts that were in flight are started again on
resume, so no finished trajectory is counted twice or lost).

Resuming (:func:`resume_point`) continues from the newest complete
checkpoint with the saved config; only a few keys (e.g. ``train.steps``) may
change.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from transformers import PreTrainedModel

from sao.config import Config, ConfigError, parse_override, to_dict, validate
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
    tmp = begin_checkpoint(ckpt_root, step)
    policy.save_pretrained(tmp / "policy")
    if critic is not None:
        critic.save_pretrained(tmp / "critic")
    return finish_checkpoint(
        ckpt_root, step, tmp, trainer_state=trainer_state, state=state, trajectories=trajectories
    )


def begin_checkpoint(ckpt_root: Path, step: int) -> Path:
    """A fresh temporary directory for checkpoint ``step`` (models go in it
    next, written by whoever holds them: this process or the trainer ranks)."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    for stale in ckpt_root.glob(".tmp_step_*"):  # left by a save that crashed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = ckpt_root / f".tmp_step_{step:06d}_{os.getpid()}"
    tmp.mkdir()
    return tmp


def finish_checkpoint(
    ckpt_root: Path,
    step: int,
    tmp: Path,
    *,
    trainer_state: dict[str, object],
    state: dict[str, Any],
    trajectories: list[Trajectory],
) -> Path:
    """Add trainer state, RNG, run state and buffered trajectories to ``tmp``
    and rename it into place as ``step_NNNNNN``, then point ``latest`` at it."""
    final = ckpt_root / f"step_{step:06d}"
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
    """The newest complete checkpoint, or None.

    ``latest`` names it; a ``step_*`` directory only ever appears by a rename
    of a fully written one, so when the pointer is missing or stale (a crash
    between the rename and the pointer update) the highest ``step_*`` is used.
    Temporary ``.tmp_step_*`` directories are never picked up."""
    pointer = ckpt_root / "latest"
    if pointer.is_file():
        path = ckpt_root / pointer.read_text().strip()
        if (path / "state.json").is_file():
            return path
    done = sorted(p for p in ckpt_root.glob("step_*") if (p / "state.json").is_file())
    return done[-1] if done else None


def load_state(path: Path) -> tuple[dict[str, Any], dict[str, Any], list[Trajectory]]:
    """``(state.json, trainer.pt contents, buffered trajectories)`` of a checkpoint."""
    state = json.loads((path / "state.json").read_text())
    blob = torch.load(path / "trainer.pt", weights_only=False, map_location="cpu")
    lines = (path / "trajectories.jsonl").read_text().splitlines()
    return state, blob, [trajectory_from_dict(json.loads(x)) for x in lines if x]


RESUMABLE_KEYS = (
    "train.steps",
    "train.max_bad_steps",
    "eval.",
    "log.",
    "rollout.engine",
    "rollout.servers",
    "rollout.launch",
    "rollout.server_",
    "rollout.request_timeout_s",
    "rollout.weights_dir",
    "model.device",
    "runtime.trainer_ranks",
    "runtime.rollout_workers",
    "runtime.ray_address",
    "runtime.cpus_per_",
    "runtime.gpus_per_",
)
"""Config keys (or prefixes) that may change when a run is resumed: where the
rollouts are generated (the engine is given the saved policy and version at
start) but not how; any other change would not match the saved optimizer,
buffer or prompt stream."""


def saved_config(run_dir: Path, overrides: Sequence[str] = ()) -> Config:
    """The config a run directory was started with, plus ``--set`` overrides."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(
            f"cannot resume {str(run_dir)!r}: it holds no config.yaml, so it is not a run "
            "directory (pass the log.run_dir of an earlier `sao train`)"
        )
    data = yaml.safe_load(path.read_text())
    for item in overrides:  # no preset underneath: the saved config is complete
        data = _updated(data, parse_override(item))
    return validate(data)


def _updated(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        both = isinstance(v, dict) and isinstance(out.get(k), dict)
        out[k] = _updated(out[k], v) if both else v
    return out


def resume_point(run_dir: Path, cfg: Config) -> tuple[Config, Path]:
    """Check that ``cfg`` may continue ``run_dir``; returns it (with ``log.run_dir``
    set to ``run_dir``) and the checkpoint to start from.

    Only :data:`RESUMABLE_KEYS` may differ from the saved config (e.g. a larger
    ``train.steps``). Metrics logged after that checkpoint are removed from
    ``metrics.jsonl``: those steps run again, so no step number appears twice."""
    saved = _flat(to_dict(saved_config(run_dir)))
    given = _flat(to_dict(cfg))
    changed = [
        k
        for k in sorted(saved.keys() | given.keys())
        if saved.get(k) != given.get(k) and not k.startswith(RESUMABLE_KEYS)
    ]
    if changed:
        diffs = ", ".join(f"{k} ({saved.get(k)!r} -> {given.get(k)!r})" for k in changed)
        raise ConfigError(
            f"cannot resume {str(run_dir)!r} with a different {diffs}; only "
            f"{', '.join(RESUMABLE_KEYS)} may change on resume (start a new run instead)"
        )
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise ConfigError(
            f"cannot resume {str(run_dir)!r}: it holds no complete checkpoint; delete it "
            "and start again, or pick another log.run_dir"
        )
    step = int(json.loads((ckpt / "state.json").read_text())["step"])
    rewind_metrics(run_dir / "metrics.jsonl", step)
    log = cfg.log.model_copy(update={"run_dir": str(run_dir)})
    return cfg.model_copy(update={"log": log}), ckpt


def rewind_metrics(path: Path, step: int) -> None:
    """Drop the rows of ``metrics.jsonl`` logged after ``step`` (atomically)."""
    if not path.is_file():
        return
    rows = [x for x in path.read_text().splitlines() if x.strip()]
    kept = [x for x in rows if json.loads(x)["step"] <= step]
    if len(kept) == len(rows):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(x + "\n" for x in kept))
    os.replace(tmp, path)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "options":
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[prefix + k] = v
    return out
