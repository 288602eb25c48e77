"""Checkpoints that a crash cannot corrupt: everything is written into a
temporary directory, a manifest of every file's size and SHA-256 last
(:mod:`sao.rundir.manifest`), then the directory is renamed into place and
``latest`` is replaced atomically; only then are checkpoints beyond the
newest ``log.keep_checkpoints`` deleted.

A checkpoint holds the actor and critic (Hugging Face format), both optimizers
and the LR schedule, RNG states, step and version, the running-mean state,
the staleness counters, the buffer's finished trajectories, and where the
prompt stream stands (prompts that were in flight are started again on
resume, so no finished trajectory is counted twice or lost).

Resuming (:func:`resume_point`) continues from the newest intact checkpoint
(:func:`intact_checkpoint`: a damaged one is skipped, saying why) with the
saved config; only a few keys (e.g. ``train.steps``) may change. A run that
stopped before its first checkpoint starts over from scratch.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import yaml
from transformers import PreTrainedModel

from sao.config import Config, ConfigError, parse_override, to_dict, validate
from sao.models.lora import save_policy
from sao.models.value import ValueModel
from sao.rundir.failures import FAILURES
from sao.rundir.ledger import LEDGER
from sao.rundir.manifest import MANIFEST, manifest_problem, write_manifest
from sao.rundir.metrics import read_jsonl, write_jsonl
from sao.rundir.transcripts import EVAL_SAMPLES
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


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` so that a crash leaves the old file or the new one, never
    part of it (a ``.tmp`` sibling renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
    keep: int = 0,
) -> Path:
    """Write checkpoint ``step`` under ``ckpt_root`` atomically; returns its path."""
    tmp = begin_checkpoint(ckpt_root, step)
    save_policy(policy, tmp / "policy")
    if critic is not None:
        critic.save_pretrained(tmp / "critic")
    return finish_checkpoint(
        ckpt_root,
        step,
        tmp,
        trainer_state=trainer_state,
        state=state,
        trajectories=trajectories,
        keep=keep,
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
    keep: int = 0,
) -> Path:
    """Add trainer state, RNG, run state and buffered trajectories to ``tmp``,
    then its manifest (last), and rename it into place as ``step_NNNNNN``;
    point ``latest`` at it, then delete all but the ``keep`` newest
    checkpoints (0: keep all)."""
    final = ckpt_root / f"step_{step:06d}"
    torch.save({"trainer": trainer_state, "rng": rng_state()}, tmp / "trainer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2))
    with (tmp / "trajectories.jsonl").open("w") as f:
        for t in trajectories:
            f.write(json.dumps(trajectory_to_dict(t)) + "\n")
    write_manifest(tmp)
    if final.exists():  # left by a timeline abandoned on resume: never half-deleted in place
        _discard(final)
    os.replace(tmp, final)
    pointer = ckpt_root / ".latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, ckpt_root / "latest")
    if keep > 0:
        prune_checkpoints(ckpt_root, keep, final)
    return final


def _step_dirs(ckpt_root: Path) -> list[Path]:
    """The ``step_NNNNNN`` directories, oldest first."""
    found = [p for p in ckpt_root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _discard(path: Path) -> None:
    """Delete a checkpoint directory so that a crash half-way leaves nothing
    that looks like one: it is renamed to ``.tmp_step_*`` first (swept away by
    the next :func:`begin_checkpoint` if the deletion does not finish)."""
    trash = path.with_name(f".tmp_{path.name}_old_{os.getpid()}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def prune_checkpoints(ckpt_root: Path, keep: int, newest: Path) -> list[Path]:
    """Delete the checkpoints older than ``newest`` but the ``keep - 1`` most
    recent of them; returns those deleted. Call only once ``newest`` and
    ``latest`` are in place."""
    step = int(newest.name[5:])
    older = [p for p in _step_dirs(ckpt_root) if int(p.name[5:]) < step]
    doomed = older[: max(len(older) - (keep - 1), 0)]
    for path in doomed:
        _discard(path)
    return doomed


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


def saved_counters(path: Path | None) -> dict[str, float]:
    """The orchestrator's running totals saved in checkpoint ``path`` ({} for
    none, or a checkpoint older than them): see ``Orchestrator.counters``."""
    if path is None:
        return {}
    counters = json.loads((path / "state.json").read_text()).get("counters", {})
    return {str(k): float(v) for k, v in counters.items()}


def checkpoint_problem(path: Path) -> str | None:
    """Why checkpoint ``path`` cannot be resumed from, or None when it is intact:
    every file matches its manifest or, for a checkpoint older than manifests,
    its state, trainer state, trajectories, safetensors and JSON files load."""
    if (path / MANIFEST).is_file():
        return manifest_problem(path)
    try:
        load_state(path)
        for f in sorted(path.rglob("*.safetensors")):
            safetensors.torch.load_file(f)
        for f in sorted(path.rglob("*.json")):
            json.loads(f.read_text())
    except Exception as e:  # whatever a damaged file makes torch, pickle or json raise
        return f"it has no {MANIFEST} (an older run's) and does not load: {type(e).__name__}: {e}"
    return None


def intact_checkpoint(ckpt_root: Path, say: Callable[[str], None] = print) -> Path | None:
    """The newest checkpoint under ``ckpt_root`` that passes
    :func:`checkpoint_problem`; None when there is no checkpoint at all.

    Each damaged one found on the way is named with its problem through
    ``say`` and moved aside to ``.damaged_step_NNNNNN`` (kept for inspection,
    never resumed from or pruned). When every checkpoint is damaged this raises
    :class:`~sao.config.ConfigError`: resuming again then starts over."""
    damaged = []
    for path in reversed(_step_dirs(ckpt_root)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        aside = _aside(path)
        say(f"resume: skipping damaged checkpoint {path.name}: {problem} (moved to {aside.name})")
        damaged.append(path.name)
    if damaged:
        raise ConfigError(
            f"every checkpoint in {str(ckpt_root)!r} is damaged ({', '.join(damaged)}, "
            "moved aside as .damaged_*); resume again to start the run over from scratch"
        )
    return None


def _aside(path: Path) -> Path:
    for i in range(1000):
        target = path.with_name(f".damaged_{path.name}" + (f".{i}" if i else ""))
        if not target.exists():
            os.replace(path, target)
            return target
    raise OSError(f"cannot move {path} aside: too many damaged copies of it")


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
    "runtime.critic_ranks",
    "runtime.threads_per_rank",
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
            "directory (pass the log.run_dir of an earlier `sao train`; one killed before "
            "it wrote its config.yaml is started again with plain `sao train`)"
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


def resume_point(run_dir: Path, cfg: Config) -> tuple[Config, Path | None]:
    """Check that ``cfg`` may continue ``run_dir``; returns it (with ``log.run_dir``
    set to ``run_dir``) and the checkpoint to start from: the newest intact one
    (:func:`intact_checkpoint`), or None to start over from scratch when the
    run stopped before its first checkpoint.

    Only :data:`RESUMABLE_KEYS` may differ from the saved config (e.g. a larger
    ``train.steps``). Rows logged after that checkpoint are removed from
    ``metrics.jsonl``, ``ledger.jsonl``, ``failures.jsonl`` and ``eval_samples.jsonl``
    (all of them when starting over):
    those steps run again, so no step number appears twice."""
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
    ckpt = intact_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        print(
            f"resume: {run_dir} stopped before its first checkpoint; "
            "starting it over from scratch with its saved config.yaml"
        )
        step = -1
    else:
        step = int(json.loads((ckpt / "state.json").read_text())["step"])
        print(f"resume: continuing {run_dir} from checkpoint {ckpt.name}")
    for name in ("metrics.jsonl", LEDGER, FAILURES, EVAL_SAMPLES):
        rewind_metrics(run_dir / name, step)
    log = cfg.log.model_copy(update={"run_dir": str(run_dir)})
    return cfg.model_copy(update={"log": log}), ckpt


def rewind_metrics(path: Path, step: int) -> None:
    """Drop the rows of ``metrics.jsonl`` (or any JSON-lines log with a
    ``step`` per row) logged after ``step``, and a last line torn by a kill
    mid-write (atomically)."""
    if not path.is_file():
        return
    rows = read_jsonl(path)
    kept = [r for r in rows if r["step"] <= step]
    if len(kept) < len(rows) or not path.read_bytes().endswith(b"\n"):
        write_jsonl(path, kept)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "options":
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[prefix + k] = v
    return out
