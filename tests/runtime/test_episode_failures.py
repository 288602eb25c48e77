"""A run never hangs on a failed episode and never trains one as its score:
failures are recorded, give their capacity back, and stop the run only when
it cannot go on (too many in a row, or nothing progresses)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from sao.app.run import train
from sao.cli import main
from sao.config import load_config
from sao.envs.base import Split
from sao.runtime.orchestrator import RunStopped
from sao.types import Env, StepResult
from tests.train.test_learning import SayAEnv, SayATask


class FlakyTask(SayATask):
    """SayA, but ``make_env`` raises for every third train index."""

    def make_env(self, split: Split, index: int) -> Env:
        if split == "train" and index % 3 == 2:
            raise KeyError(f"no problem {index}")
        return SayAEnv()


class CrashAfterAnswer(SayAEnv):
    """Records the answer (so its score is 1.0), then crashes."""

    async def step(self, action: str) -> StepResult:
        self.reply = "aaaa"
        raise RuntimeError("grader went away")


class CrashTask(SayATask):
    def make_env(self, split: Split, index: int) -> Env:
        return CrashAfterAnswer() if split == "train" else SayAEnv()


class HangingEnv(SayAEnv):
    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


class HangTask(SayATask):
    def make_env(self, split: Split, index: int) -> Env:
        return HangingEnv() if split == "train" else SayAEnv()


def overrides(tmp_path: Path, policy: Path, *extra: str) -> list[str]:
    return [
        f"model.path={policy}",
        f"log.run_dir={tmp_path / 'run'}",
        "log.live=false",
        "log.tensorboard=false",
        "log.plots=false",
        "train.steps=12",
        "train.batch_size=8",
        "runtime.max_lag=1",
        "rollout.in_flight=8",
        "rollout.max_new_tokens=4",
        "rollout.max_turns=1",
        "rollout.max_total_tokens=64",
        "eval.every=100",
        "eval.episodes=4",
        "log.checkpoint_every=100",
        "train.logprob_budget=0",
        *extra,
    ]


def history(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algo", ["sao", "grpo"])
def test_failing_make_env_is_recorded_and_the_run_finishes(tmp_path, tiny_policy, algo):
    extra = ["algo=grpo", "algo.group_size=4"] if algo == "grpo" else ["algo=sao"]
    cfg = load_config(overrides=overrides(tmp_path, tiny_policy, *extra))
    run_dir = train(cfg, task=FlakyTask())
    rows = history(run_dir)
    last = rows[-1]
    # twelve steps of 8: more than the (max_lag + 1) x 8 = 16 episodes a leak would allow
    assert last["step"] == 12 + (10 if algo == "sao" else 0)
    assert last["episodes/error"] >= 4 and last["episodes/failed"] == last["episodes/error"]
    failures = [json.loads(x) for x in (run_dir / "failures.jsonl").read_text().splitlines()]
    assert len(failures) >= last["episodes/failed"]  # more may fail after the last step
    assert all(f["reason"] == "error" and "make_env('train'" in f["error"] for f in failures)
    assert all(int(f["prompt_id"].split("/")[1]) % 3 == 2 for f in failures)
    if algo == "grpo":  # a group with a failed member is dropped whole
        assert last["dropped/failed"] >= 4 and last["dropped/failed"] % 4 == 0


def test_a_failure_never_trains_as_its_score(tmp_path, tiny_policy):
    cfg = load_config(
        overrides=overrides(
            tmp_path, tiny_policy, "algo=sao", "algo.critic_pretrain_steps=0",
            "train.steps=3", "rollout.failure_reward=-1.0",
        )
    )  # fmt: skip
    rows = history(train(cfg, task=CrashTask()))
    rewards = [r["train/reward_mean"] for r in rows if "train/reward_mean" in r]
    assert rewards == [-1.0, -1.0, -1.0]  # the score was 1.0: trained as the failure reward
    assert rows[-1]["episodes/env_error"] >= 24


def test_dropped_failures_in_a_row_stop_the_run_cleanly(tmp_path, tiny_policy, capsys):
    cfg = load_config(
        overrides=overrides(tmp_path, tiny_policy, "rollout.max_failures_in_a_row=20")
    )
    with pytest.raises(RunStopped, match=r"20 episodes in a row failed .* grader went away"):
        train(cfg, task=CrashTask())


def test_watchdog_says_what_each_episode_waits_on(tmp_path, tiny_policy):
    cfg = load_config(
        overrides=overrides(
            tmp_path, tiny_policy, "runtime.watchdog_s=1.5", "rollout.step_timeout_s=1000"
        )
    )
    with pytest.raises(RunStopped) as err:
        train(cfg, task=HangTask())
    message = str(err.value)
    assert "no episode finished and no step completed for" in message
    assert "runtime.watchdog_s=1.5" in message and "8 episode(s) in flight" in message
    assert "train/0: Env.step of turn 1 for" in message


def test_cli_reports_a_stopped_run_without_traceback(tmp_path, tiny_policy, capsys):
    code = main(
        [
            "train",
            "--preset",
            "calc-tiny",
            "--set",
            f"model.path={tiny_policy}",
            "--set",
            f"log.run_dir={tmp_path / 'run'}",
            "--set",
            "rollout.max_total_tokens=8",  # every calc-tiny prompt is longer: all fail
            "--set",
            "rollout.max_failures_in_a_row=10",
            "--set",
            "log.live=false",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "sao: stopped: 10 episodes in a row failed" in err and "first prompt has" in err
