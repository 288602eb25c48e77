"""Tiny starting policies for the built-in tasks: a character tokenizer, a
tiny Llama, supervised fine-tuning on the task's imperfect demonstrations,
cached under ``$SAO_HOME`` keyed by a hash of everything that built it."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from sao.app.engines import context_window
from sao.envs.registry import make_task
from sao.models.cache import build_cached, cached_model_dir, sao_home
from sao.models.loading import load_policy, load_tokenizer
from sao.models.sft import sft
from sao.models.tiny import build_tiny_policy
from sao.models.tokenization import build_char_tokenizer
from sao.rollout.agent import EpisodeLimits
from sao.rollout.embedded.engine import TorchEngine
from sao.runtime.evaluate import EvalResult, evaluate
from sao.runtime.runner import LocalRunner
from sao.runtime.transcripts import Transcript, transcripts


@dataclass(frozen=True)
class WarmStartRecipe:
    """How a task's tiny policy is built (hashed into its cache key)."""

    demos: int = 4000
    epochs: int = 3
    lr: float = 2e-3
    batch_size: int = 16
    max_len: int = 384
    schedule: Literal["linear", "constant"] = "linear"
    """SFT learning-rate schedule (see :func:`sao.models.sft.sft`)."""


RECIPES: dict[str, WarmStartRecipe] = {
    "calculator": WarmStartRecipe(demos=4000, epochs=3, lr=2e-3, batch_size=16, max_len=384),
    # Each recipe below leaves the greedy held-out success of its tiny preset
    # (guess-tiny, python-tiny, style-shift-tiny, rgym-tiny) between 15% and 70%
    # and trains on at most ~1.2M tokens. Tasks that copy text from the prompt
    # need lr 1e-3 and batch 8: at 2e-3, or with fewer steps, copying is never learned.
    # A constant LR keeps python_tool (0.115 with the linear decay) and reasoning_gym
    # (0.905 with it) inside the range.
    "guess_number": WarmStartRecipe(demos=1500, epochs=2, lr=2e-3, batch_size=16),
    "style_shift": WarmStartRecipe(demos=4000, epochs=3, lr=1e-3, batch_size=8),
    "python_tool": WarmStartRecipe(
        demos=4000, epochs=3, lr=1e-3, batch_size=8, schedule="constant"
    ),
    "reasoning_gym": WarmStartRecipe(
        demos=3000, epochs=3, lr=1e-3, batch_size=8, schedule="constant"
    ),
    "dataset": WarmStartRecipe(demos=2000),
    # swe demonstrations are ~340 characters; 512 keeps 99% of them whole.
    "swe": WarmStartRecipe(demos=3000, epochs=3, lr=1e-3, batch_size=8, max_len=512),
}
RECIPE_VERSION = 3
"""Bump when the build procedure changes, so old caches are not reused."""

USUAL_BUILD_S: dict[str, float] = {
    "calculator": 70,
    "guess_number": 51,
    "style_shift": 98,
    "python_tool": 109,
    "reasoning_gym": 52,
    "swe": 473,
}
"""Seconds the 1M-parameter warm start of each task took to build on 2 cores
(BENCHMARKS.md, "Warm-started tiny policies" and swe-tiny): what the line
printed before a build tells a first-time user to expect."""


def build_notice(task_name: str, size: str = "1m") -> str:
    """The line printed before a warm start is built: what, where, how long.

    E.g. ``building the calculator task's warm-started policy (once, then cached
    in ~/.cache/sao; about 70 s on 2 idle cores, longer on busy ones) ...``.
    Busy cores slow it far more than their share: 141 s, 431 s and 666 s were
    measured for the calculator's with other jobs on the 2 cores (load 1-4).
    """
    usual = USUAL_BUILD_S.get(task_name) if size == "1m" else None
    how_long = f"; about {usual:.0f} s on 2 idle cores, longer on busy ones" if usual else ""
    home = sao_home()
    if home.is_relative_to(Path.home()):
        home = Path("~") / home.relative_to(Path.home())
    return (
        f"building the {task_name} task's warm-started policy "
        f"(once, then cached in {home}{how_long}) ..."
    )


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _recipe(task: str, options: dict[str, Any], size: str, arch: str, seed: int) -> dict[str, Any]:
    r = RECIPES.get(task, WarmStartRecipe())
    return {
        "version": RECIPE_VERSION,
        "task": task,
        "options": options,
        "size": size,
        "arch": arch,
        "seed": seed,
        **vars(r),
    }


def policy_dir(
    task: str, options: dict[str, Any], *, size: str = "1m", arch: str = "llama", seed: int = 0
) -> Path:
    """Where the cached warm-started policy for this recipe lives (may not exist)."""
    return cached_model_dir("policy", _recipe(task, options, size, arch, seed))


def ensure_policy(
    task_name: str,
    options: dict[str, Any] | None = None,
    *,
    size: str = "1m",
    arch: str = "llama",
    seed: int = 0,
    progress: bool = True,
    say: Callable[[str], None] = _to_stderr,
) -> Path:
    """The warm-started tiny policy for a built-in task: cached, or built now.

    A build is announced: ``say`` gets :func:`build_notice` before it and the
    seconds it took after (stderr by default, so stdout stays the command's
    own output); a cached policy is returned silently.
    """
    options = dict(options or {})
    recipe = _recipe(task_name, options, size, arch, seed)
    r = RECIPES.get(task_name, WarmStartRecipe())

    def build(tmp: Path) -> None:
        t0 = time.perf_counter()
        say(build_notice(task_name, size))
        task = make_task(task_name, **options)
        tokenizer = build_char_tokenizer()
        model = build_tiny_policy(tokenizer, arch=arch, size=size, seed=seed)
        conversations = task.demonstrations(r.demos, seed=seed)
        torch.manual_seed(seed)
        report = sft(
            model,
            tokenizer,
            conversations,
            epochs=r.epochs,
            lr=r.lr,
            batch_size=r.batch_size,
            max_len=r.max_len,
            schedule=r.schedule,
            seed=seed,
            progress=progress,
        )
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {"sft_final_loss": report.final_loss, "build_s": time.perf_counter() - t0}
        (tmp / "warmstart.json").write_text(json.dumps(info, indent=2) + "\n")
        say(f"built the {task_name} task's warm-started policy in {info['build_s']:.1f} s")

    return build_cached("policy", recipe, build)


def held_out_success(
    model_dir: Path,
    task_name: str,
    options: dict[str, Any] | None = None,
    *,
    episodes: int = 200,
    max_new_tokens: int = 32,
    max_turns: int = 6,
    max_total_tokens: int = 320,
) -> float:
    """Greedy held-out success of a policy directory on a built-in task."""
    success, _ = held_out(
        model_dir,
        task_name,
        options,
        episodes=episodes,
        max_new_tokens=max_new_tokens,
        max_turns=max_turns,
        max_total_tokens=max_total_tokens,
    )
    return success


def held_out(
    model_dir: Path,
    task_name: str,
    options: dict[str, Any] | None = None,
    *,
    episodes: int = 200,
    max_new_tokens: int = 32,
    max_turns: int = 6,
    max_total_tokens: int = 320,
    show: int = 0,
) -> tuple[float, list[Transcript]]:
    """:func:`held_out_success` and the transcripts of the first ``show`` episodes."""
    task = make_task(task_name, **(options or {}))
    tokenizer = load_tokenizer(model_dir)
    model = load_policy(model_dir)
    limits = EpisodeLimits(max_turns=max_turns, max_total_tokens=max_total_tokens)

    async def go() -> EvalResult:
        # the KV cache holds 64 episodes of max_total_tokens, as the trainer's engine
        # does: the model's positions (4096 for SmolLM2) would take 11 GiB in float32
        context = context_window(model, max_total_tokens)
        with TorchEngine(
            model, max_batch_size=64, max_seq_len=context, tokenizer=tokenizer
        ) as engine:
            runner = LocalRunner(task, engine, tokenizer, limits)
            return await evaluate(runner, episodes=episodes, max_new_tokens=max_new_tokens)

    res = asyncio.run(go())
    return res.success, transcripts(res.trajectories, tokenizer, step=0, limit=show)
