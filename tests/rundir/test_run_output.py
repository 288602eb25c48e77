"""Terminal output that fits where runs happen: the rich live view on a
terminal, plain flushed lines of the same fields elsewhere (Slurm, CI,
``nohup``, a pipe), never control codes on a pipe."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest

from sao.config import ConfigError, load_config
from sao.rundir.metrics import LiveView, PlainLines, RunLogger


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def metrics(step: int) -> dict[str, float]:
    m = {"train/reward_mean": step / 100, "staleness/mean": 0.5, "critic/loss": 1.0}
    return m | ({"eval/success": 0.25} if step % 20 == 0 or step == 25 else {})


def _untimed(line: str) -> str:
    """A step line without its elapsed time (``0:00:12``, checked here), other lines as they are."""
    if not line.startswith("sao step "):
        return line
    head, elapsed = line.rsplit(" ", 1)
    assert re.fullmatch(r"\d+:\d\d:\d\d", elapsed), line
    return head


def test_a_pipe_gets_plain_lines_as_the_steps_happen(tmp_path: Path) -> None:
    out = io.StringIO()
    logger = RunLogger(tmp_path, total_steps=25, tensorboard=False, print_every=10, stream=out)
    assert isinstance(logger.view, PlainLines)  # live="auto" on a stream that is no terminal
    logger.log(0, {"wall_s": 0.0, "eval/success": 0.125})
    logger.print("gate: [max_lag 1]")  # printed as it is (no rich markup on a pipe)
    logger.log(1, metrics(1))
    assert out.getvalue().splitlines()[-1].startswith("sao step 1/25 ")  # at once, not at the end
    for step in range(2, 26):
        logger.log(step, metrics(step))
    logger.close()
    lines = [_untimed(line) for line in out.getvalue().splitlines()]
    # step 0 (a multiple of 10), the first step trained, every 10th, each evaluation, the last
    steps = [line.split()[2] for line in lines if line.startswith("sao step ")]
    assert steps == ["0/25", "1/25", "10/25", "20/25", "25/25"]
    assert lines[0] == "sao step 0/25 eval 0.125"
    assert lines[1] == "gate: [max_lag 1]"
    assert lines[3] == "sao step 10/25 reward 0.100 stale 0.500"
    assert lines[-1] == "sao step 25/25 reward 0.250 eval 0.250 stale 0.500"
    assert "\x1b" not in out.getvalue()


def test_print_every_zero_prints_messages_only(tmp_path: Path) -> None:
    out = io.StringIO()
    with RunLogger(tmp_path, total_steps=3, tensorboard=False, print_every=0, stream=out) as log:
        for step in range(4):
            log.log(step, metrics(step))
        log.print("done")
    assert out.getvalue() == "done\n"


def test_a_resumed_run_prints_its_first_step(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s}) + "\n" for s in range(41))
    )
    out = io.StringIO()
    with RunLogger(tmp_path, total_steps=100, tensorboard=False, stream=out) as logger:
        for step in range(41, 45):
            logger.log(step, metrics(step))
    assert [line.split()[2] for line in out.getvalue().splitlines()] == ["41/100"]


def test_live_auto_picks_the_rich_view_only_on_a_terminal(tmp_path: Path) -> None:
    def logger(stream: io.StringIO, live: bool | Literal["auto"] = "auto") -> RunLogger:
        return RunLogger(tmp_path, total_steps=3, tensorboard=False, live=live, stream=stream)

    tty = Terminal()
    with logger(tty) as log:
        assert isinstance(log.view, LiveView)
        log.log(1, metrics(1))
    assert "\x1b[" in tty.getvalue()  # the live view redraws with control codes
    with logger(Terminal(), live=False) as log:
        assert isinstance(log.view, PlainLines)  # false: plain lines even on a terminal
    forced = logger(io.StringIO(), live=True)
    assert isinstance(forced.view, LiveView)  # true: the live view even on a pipe
    forced.close()
    forced.close()  # again: nothing happens


def test_log_live_takes_auto_true_and_false() -> None:
    assert load_config().log.live == "auto"
    assert load_config(overrides=["log.live=false"]).log.live is False
    assert load_config(overrides=["log.live=auto", "log.print_every=0"]).log.print_every == 0
    with pytest.raises(ConfigError, match=r"log\.live"):
        load_config(overrides=["log.live=sometimes"])


@pytest.mark.slow
def test_sao_train_on_a_pipe_prints_plain_lines_during_the_run(
    tmp_path: Path, tiny_policy: Path
) -> None:
    """The real command, stdout to a pipe (as under Slurm or ``nohup``), log.live left at auto."""
    run_dir = tmp_path / "run"
    sets = [
        f"model.path={tiny_policy}", "task.name=guess_number", f"log.run_dir={run_dir}",
        "log.tensorboard=false", "log.plots=false", "train.steps=6", "train.batch_size=4",
        "rollout.in_flight=4", "rollout.max_new_tokens=4", "rollout.max_turns=1",
        "rollout.max_total_tokens=64", "eval.every=3", "eval.episodes=2",
        "log.checkpoint_every=100", "log.print_every=2", "algo.critic_pretrain_steps=0",
    ]  # fmt: skip
    argv = [sys.executable, "-m", "sao.cli", "train", *(a for s in sets for a in ("--set", s))]
    with (tmp_path / "stderr").open("w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout is not None
        lines, running_at_step_1 = [], False
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("sao step 1/6 "):
                running_at_step_1 = proc.poll() is None
        assert proc.wait(timeout=240) == 0, (tmp_path / "stderr").read_text()[-2000:]
    assert running_at_step_1  # printed while the run went on, not at its end
    out = "".join(lines)
    assert "\x1b" not in out
    steps = [line.split() for line in lines if line.startswith("sao step ")]
    assert [s[2] for s in steps] == ["0/6", "1/6", "2/6", "3/6", "4/6", "6/6"]
    assert steps[0][3] == "eval" and steps[1][3] == "reward" and "stale" in steps[1]
    assert "eval" in steps[3] and "eval" in steps[-1]  # the evaluations at steps 3 and 6
    assert (run_dir / "summary.json").is_file()
