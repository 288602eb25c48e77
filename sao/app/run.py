"""The ``sao train`` recipe: compose task, policy, critic, engine, trainer and
the asynchronous orchestrator from a :class:`~sao.config.Config`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import torch
import yaml
from transformers.utils import logging as hf_logging

from sao.agents.endpoint import AgentEndpoint
from sao.agents.runner import AgentRunner, AgentTask
from sao.app.cpu import bfloat16_warning
from sao.app.engines import Publish, budget_for, open_rollout_engine, weight_dtypes
from sao.app.memory import (
    available_bytes,
    check_memory,
    estimate_peak,
    estimate_ray_peak,
    longest_prompt,
)
from sao.app.parts import (
    Parts,
    TrainTask,
    build_failure_policy,
    build_parts,
    model_shells,
    policy_path,
)
from sao.config import Config, ConfigError, to_dict
from sao.rollout.engine import Engine
from sao.rollout.resume import EpisodeResume
from sao.rundir.checkpoint import (
    begin_checkpoint,
    finish_checkpoint,
    load_state,
    resume_point,
    saved_counters,
    set_rng_state,
    write_text_atomic,
)
from sao.rundir.failures import FAILURES, FailureLog
from sao.rundir.ledger import Ledger
from sao.rundir.metrics import RunLogger, summarize, write_plots
from sao.rundir.model_card import export_final
from sao.runtime.admission import JustInTime
from sao.runtime.buffer import TrajectoryBuffer
from sao.runtime.evaluate import evaluate, logprob_gate
from sao.runtime.memory import (
    GIB,
    MemoryMeter,
    process_tree_rss,
    publish_expected_peak,
    reserved_bytes,
)
from sao.runtime.orchestrator import Orchestrator, Report, RolloutState
from sao.runtime.runner import EpisodeRunner, LocalRunner
from sao.runtime.staleness import StalenessGate
from sao.runtime.trainers import LocalTrainer, TrainerHandle
from sao.runtime.transcripts import EVAL_SAMPLES, EvalSamples, last_evaluation
from sao.train.critic_fit import heldout_fit, heldout_fit_by_turn
from sao.train.guard import NonFiniteError
from sao.types import FAILURES as FAILED
from sao.types import Trajectory


def prepare_run_dir(cfg: Config, resume: bool) -> Path:
    """Create (or reopen, when resuming) the run directory; never mix two runs."""
    if cfg.log.run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = Path("runs") / f"{cfg.task.name}-{cfg.algo.preset}-{stamp}"
    else:
        run_dir = Path(cfg.log.run_dir)
    if resume:
        return run_dir
    # a config.yaml.tmp alone: killed while writing the config, before anything ran
    if run_dir.exists() and any(p.name != "config.yaml.tmp" for p in run_dir.iterdir()):
        raise ConfigError(
            f"run directory {str(run_dir)!r} already holds a run; pick another log.run_dir, "
            f"or continue it with `sao train --resume {run_dir}`"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return run_dir


def train(cfg: Config, *, task: TrainTask | None = None, resume: Path | None = None) -> Path:
    """Run training to completion; returns the run directory.

    ``task`` trains on your own :class:`~sao.envs.base.Task` instead of the
    configured built-in one (``cfg.task`` is then only a label). ``resume``
    continues that run directory from its newest intact checkpoint (or starts
    it over when it stopped before its first); ``cfg`` must match its saved
    config except for a few keys such as a larger ``train.steps`` (see
    :func:`~sao.rundir.checkpoint.resume_point`)."""
    hf_logging.disable_progress_bar()  # the run has its own live view
    ckpt = None
    if resume is not None:
        cfg, ckpt = resume_point(resume, cfg)
    run_dir = prepare_run_dir(cfg, resume is not None)
    _seed(cfg.seed)
    runtime = sum(process_tree_rss())  # (the estimate's runtime: before any model is loaded)
    meter = MemoryMeter()  # memory/*: resident now, the peak from here on, the allocator's
    try:
        parts = build_parts(cfg, ckpt, task, models=cfg.runtime.backend == "local")
        if warning := bfloat16_warning(parts.device, *weight_dtypes(cfg, parts.policy)):
            print(warning)
        meter.expected_gib = _memory_check(parts, runtime)
    except BaseException:
        if resume is None:  # nothing ran yet: leave no half-made run directory behind
            shutil.rmtree(run_dir, ignore_errors=True)
            if cfg.log.run_dir is None and not any(run_dir.parent.iterdir()):
                run_dir.parent.rmdir()  # the default runs/, made for this run alone
        raise
    return asyncio.run(_run(parts, run_dir, ckpt, task, meter))


def _memory_check(p: Parts, runtime: int) -> float | None:
    """Print the run's expected peak memory by owner and return it (GiB); refuse
    (ConfigError) a run that would not fit (``train.memory_check``). A Ray run's
    is its processes' on this machine's cluster, on the CPU (None otherwise). The
    host peak is also published for ``sao experiment --jobs`` (None: unknown)."""
    cfg = p.cfg
    ray = cfg.runtime.backend == "ray"
    if ray and (cfg.runtime.ray_address is not None or p.device.type != "cpu"):
        publish_expected_peak(None)  # (processes on other machines, or on GPUs)
        return None
    prompt = None  # an agent's prompts come from its own code
    if not isinstance(p.task, AgentTask):
        prompt = asyncio.run(longest_prompt(p.task, p.tokenizer, p.limits.reset_timeout_s))
    if ray:
        estimate = estimate_ray_peak(cfg, *model_shells(cfg), prompt, runtime)
    else:
        estimate = estimate_peak(p, prompt, runtime)
    available = available_bytes(p.device)
    reserved = reserved_bytes() if p.device.type == "cpu" else 0.0  # sao experiment --jobs
    print(check_memory(estimate, available, enforce=cfg.train.memory_check, reserved=reserved))
    publish_expected_peak(estimate.total if p.device.type == "cpu" else None)
    return estimate.total / GIB


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _restore(
    p: Parts, ckpt: Path | None, gate: StalenessGate, buffer: TrajectoryBuffer
) -> tuple[RolloutState, int, int]:
    """Trainer, RNG, gate counters and buffer from a checkpoint; returns the
    prompt stream, the step and the version to continue from."""
    if ckpt is None:
        return RolloutState(), 0, 0
    saved, blob, trajs = load_state(ckpt)
    if p.trainer is not None:  # (else the trainer ranks load checkpoint/sharded themselves)
        p.trainer.load_state_dict(blob["trainer"])
    set_rng_state(blob["rng"])
    gate.started, gate.rejected, gate.dropped = saved["gate"]
    for name in _BUFFER_COUNTERS:
        setattr(buffer, name, int(saved.get("buffer", {}).get(name, 0)))
    for t in trajs:
        buffer.add(t)
    resume = {k: EpisodeResume.from_dict(v) for k, v in saved.get("resume", {}).items()}
    state = RolloutState(next_index=saved["next_index"], restart=saved["in_flight"], resume=resume)
    return state, saved["step"], saved["version"]


def _pipeline(
    p: Parts,
    runner: EpisodeRunner,
    gate: StalenessGate,
    buffer: TrajectoryBuffer,
    restored: tuple[RolloutState, int, int],
    report: Report | None = None,
) -> Orchestrator:
    """The orchestrator over ``engine``, at the restored stream, step and version;
    ``report`` records failed episodes."""
    cfg, algo = p.cfg, p.cfg.algo.resolve()
    state, start_step, version = restored
    orch = Orchestrator(
        runner,
        p.sampling,
        gate=gate,
        buffer=buffer,
        in_flight=cfg.rollout.in_flight,
        group_size=algo.group_size,
        seed=cfg.seed,
        state=state,
        failure=build_failure_policy(cfg),
        report=report,
        admission=JustInTime(cfg.runtime.max_lag) if cfg.runtime.admission == "jit" else None,
        lockstep=cfg.runtime.admission == "fixed",
    )
    orch.consumed, orch.version = start_step, version
    return orch


async def _run(
    p: Parts,
    run_dir: Path,
    ckpt: Path | None,
    task: TrainTask | None,
    meter: MemoryMeter,
) -> Path:
    """The run loop; ``task`` is the caller's own task (None: the built-in one);
    ``meter`` reads the memory the run holds (started before the models were loaded)."""
    cfg, algo = p.cfg, p.cfg.algo.resolve()
    total = cfg.train.steps + algo.critic_pretrain_steps  # warm-up batches come first
    gate = StalenessGate(cfg.runtime.max_lag, cfg.train.batch_size)
    buffer = TrajectoryBuffer(
        gate, group_size=algo.group_size, dynamic_sampling=algo.dynamic_sampling
    )
    restored = _restore(p, ckpt, gate, buffer)
    handle = await _trainer(p, ckpt, task)
    logger = _logger(cfg, run_dir, total)
    ledger = Ledger.open(run_dir, enabled=cfg.log.ledger, start_step=restored[1])
    samples = EvalSamples(run_dir, p.tokenizer, cfg.log.eval_samples, logger)
    try:
        async with _rollout(p, handle, run_dir, restored[2], task) as (runner, publish, engine):
            report = FailureLog(run_dir / FAILURES, logger.print)
            orch = _pipeline(p, runner, gate, buffer, restored, report)
            orch.load_counters(saved_counters(ckpt))  # wall_s, episodes/*, idle: continued
            _announce(cfg, gate, logger, own_task=task is not None)
            if ckpt is None:
                budget = budget_for(p.cfg, p.policy, p.cfg.train.logprob_budget, training=True)
                await logprob_gate(budget, p.sampling, handle, runner, engine, logger.print)
                row = {"wall_s": 0.0, **await _eval(p, runner, samples, 0, handle)}
                logger.log(0, row | meter.read())

            async def on_step(step: int, m: dict[str, float]) -> None:
                m["wall_s"] = orch.clock.elapsed()
                m |= meter.read()
                if step % cfg.eval.every == 0 or step == total:
                    m |= await _eval(p, runner, samples, step, handle)
                logger.log(step, m)
                ledger.trained(step, gate.rejected)
                if step % cfg.log.checkpoint_every == 0 or step == total:
                    # snapshot on the event loop (episodes keep running), write in a thread
                    state, trajs = _rollout_snapshot(orch, buffer, gate)
                    state["resume"] = await _resumes(orch, state["in_flight"])
                    ledger.checkpoint(step, state, trajs, gate.rejected)
                    await _checkpoint(handle, run_dir, step, state, trajs, cfg.log.keep_checkpoints)

            try:
                await orch.train(
                    total,
                    cfg.train.batch_size,
                    ledger.recording(handle.step),
                    publish,
                    warmup_steps=algo.critic_pretrain_steps,  # critic-only, before actor steps
                    on_step=on_step,
                )
            except NonFiniteError as e:  # bad updates were never applied: export what is left
                await _export_stopped(handle, run_dir, cfg, logger, e)
                raise
        logger.close()
        await _finish(p, handle, run_dir, logger.history, meter.expected_gib)
    finally:
        logger.close()
        ledger.close()
        handle.close()
    return run_dir


def _logger(cfg: Config, run_dir: Path, total: int) -> RunLogger:
    """The run's metrics logger, with the trackers ``log.*`` turns on."""
    return RunLogger(
        run_dir,
        total_steps=total,
        tensorboard=cfg.log.tensorboard,
        wandb_project=cfg.log.wandb_project if cfg.log.wandb else None,
        mlflow_experiment=cfg.log.mlflow_experiment if cfg.log.mlflow else None,
        live=cfg.log.live,
        print_every=cfg.log.print_every,
        config=to_dict(cfg),
    )


def _announce(cfg: Config, gate: StalenessGate, logger: RunLogger, *, own_task: bool) -> None:
    """Print the staleness rule in force and, for the built-in tasks that run
    model-written code, the sandbox's isolation."""
    kv_kept = cfg.rollout.engine in ("torch", "http")
    kv_kept = kv_kept and not cfg.rollout.recompute_kv_on_update
    logger.print(
        gate.describe(
            in_flight=cfg.rollout.in_flight,
            kv_kept=kv_kept,
            admission=cfg.runtime.admission,
        )
    )
    if cfg.task.name in ("python_tool", "swe") and not own_task:  # where model code runs
        from sao.envs.sandbox import describe_isolation

        allow_root = bool(cfg.task.options.get("allow_root", False))
        logger.print(describe_isolation(allow_root=allow_root))


async def _export_stopped(
    handle: TrainerHandle, run_dir: Path, cfg: Config, logger: RunLogger, err: NonFiniteError
) -> None:
    """Export the policy as it was before the non-finite update, saying why it stopped."""
    await export_final(
        handle,
        run_dir / "final",
        cfg,
        logger.history,
        stopped=str(err),
        samples=last_evaluation(run_dir / EVAL_SAMPLES),
    )


async def _trainer(p: Parts, ckpt: Path | None, task: TrainTask | None) -> TrainerHandle:
    """The trainer: this process's, or ``runtime.trainer_ranks`` Ray actors
    (which load the checkpoint's sharded state themselves)."""
    if p.cfg.runtime.backend == "local":
        return LocalTrainer(p, release=p.cfg.train.release_memory)
    from sao.app.distributed import RAY_BUILDERS
    from sao.distributed.trainer import RayTrainerGroup

    if isinstance(task, AgentTask):
        raise ConfigError("an AgentTask trains with runtime.backend=local for now")
    group = await RayTrainerGroup.start(p.cfg, ckpt, RAY_BUILDERS.rank)
    if ckpt is not None:
        await group.load(ckpt)
    return group


@contextlib.asynccontextmanager
async def _rollout(
    p: Parts, handle: TrainerHandle, run_dir: Path, version: int, task: TrainTask | None
) -> AsyncIterator[tuple[EpisodeRunner, Publish, Engine | None]]:
    """Where episodes run (``runtime.backend``) and how weights reach them; an
    :class:`~sao.agents.AgentTask` plays against the agent endpoint."""
    cfg = p.cfg
    model_dir = policy_path(cfg)
    if cfg.runtime.backend == "ray":
        assert not isinstance(task, AgentTask)  # refused when the trainer started
        from sao.app.distributed import RAY_BUILDERS
        from sao.distributed.backend import open_ray_rollout

        opened = open_ray_rollout(
            cfg, p.policy, handle, model_dir, run_dir, version, task, RAY_BUILDERS
        )
        async with opened as (ray_runner, publish):
            yield ray_runner, publish, None
        return
    async with open_rollout_engine(cfg, p.policy, p.tokenizer, model_dir, run_dir, version) as (
        engine,
        publish,
    ):
        if not isinstance(p.task, AgentTask):
            yield LocalRunner(p.task, engine, p.tokenizer, p.limits), publish, engine
            return
        endpoint = AgentEndpoint(engine, p.tokenizer, max_seq_len=cfg.rollout.max_total_tokens)
        await endpoint.start()
        try:
            yield AgentRunner(p.task, endpoint, cfg.rollout.agent_export), publish, engine
        finally:
            await endpoint.close()


async def _eval(
    p: Parts, runner: EpisodeRunner, samples: EvalSamples, step: int, handle: TrainerHandle
) -> dict[str, float]:
    """Held-out evaluation at ``step``: its metrics, with how well the critic's value at
    each held-out prompt predicts the reward (``eval/critic_ev``, ``eval/critic_auc``)
    and its value at the start of each later turn (``eval/critic_{ev,auc}_turnK``);
    its transcripts go to ``samples``."""
    r = await evaluate(
        runner, episodes=p.cfg.eval.episodes, max_new_tokens=p.cfg.rollout.max_new_tokens
    )
    samples.record(step, r.trajectories)
    if not p.cfg.algo.resolve().use_critic:
        return r.metrics()
    values = await handle.turn_values(list(r.trajectories))
    rewards = [0.0 if t.finish_reason in FAILED else t.reward for t in r.trajectories]
    first = [v[0] if v else math.nan for v in values]
    return r.metrics() | heldout_fit(first, rewards) | heldout_fit_by_turn(values, rewards)


_BUFFER_COUNTERS = ("filtered", "failed")
"""Running totals of the buffer, checkpointed (``dropped/filtered``, failed episodes)."""


def _rollout_snapshot(
    orch: Orchestrator, buffer: TrajectoryBuffer, gate: StalenessGate
) -> tuple[dict[str, object], list[Trajectory]]:
    """Prompt stream + gate counters + finished trajectories. Prompts in flight
    are restarted on resume: their finished members are kept in the buffer
    snapshot only when the whole group is not restarted."""
    in_flight = sorted(orch.state.in_flight) + list(orch.state.restart)
    restarted = {f"train/{i}" for i in in_flight}
    trajs = [t for t in buffer.snapshot() if t.group_id not in restarted]
    running = len(buffer.snapshot()) - len(trajs) + sum(orch.state.in_flight.values())
    state = {
        "version": orch.version,
        "next_index": orch.state.next_index,
        "in_flight": in_flight,
        "gate": [gate.started - running, gate.rejected, gate.dropped],
        "buffer": {name: getattr(buffer, name) for name in _BUFFER_COUNTERS},
        "counters": orch.counters(),
    }
    return state, trajs


async def _resumes(orch: Orchestrator, in_flight: object) -> dict[str, object]:
    """The episodes in flight that a resumed run can continue (between turns, with
    a restorable environment), as JSON; the others start again."""
    indices = [int(i) for i in in_flight] if isinstance(in_flight, list) else []
    return {k: r.to_dict() for k, r in (await orch.take_resumes(indices)).items()}


async def _checkpoint(
    handle: TrainerHandle,
    run_dir: Path,
    step: int,
    state: dict[str, object],
    trajs: list[Trajectory],
    keep: int,
) -> None:
    """Models from the trainer (wherever it runs), then the rest, renamed into
    place; then all but the ``keep`` newest checkpoints are deleted (0: none)."""
    root = run_dir / "checkpoints"
    tmp = await asyncio.to_thread(begin_checkpoint, root, step)
    await handle.save_models(tmp)
    await asyncio.to_thread(
        finish_checkpoint,
        root,
        step,
        tmp,
        trainer_state=handle.trainer_state(),
        state=state,
        trajectories=trajs,
        keep=keep,
    )


async def _finish(
    p: Parts,
    handle: TrainerHandle,
    run_dir: Path,
    history: list[dict[str, float]],
    expected: float | None,
) -> None:
    """Plots, the final policy with its model card, then ``summary.json``: written
    last (atomically), it marks the run finished (a run killed before it resumes
    from its last checkpoint, at the final step, and only finishes)."""
    if p.cfg.log.plots:
        write_plots(history, run_dir)
    shown = last_evaluation(run_dir / EVAL_SAMPLES)
    await export_final(handle, run_dir / "final", p.cfg, history, samples=shown)
    summary = summarize(history)
    if expected is not None:
        summary["memory/expected_peak_gib"] = expected
    write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
