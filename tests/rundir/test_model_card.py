"""``RUN_DIR/final`` carries a model card (``README.md``): config, algorithm,
steps and trajectories, first/last/best held-out success; a stopped run's
card says it stopped and why."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from sao.app.run import train
from sao.config import load_config
from sao.rundir.model_card import model_card
from sao.runtime.transcripts import Transcript
from sao.train.guard import NonFiniteError
from tests.train.test_learning import SayATask
from tests.train.test_nonfinite_run import overrides as diverging


def card_yaml(card: str) -> dict[str, Any]:
    """The configuration block of a card."""
    found = re.search(r"```yaml\n(.*?)```", card, re.S)
    assert found, card
    return yaml.safe_load(found.group(1))


def test_the_final_export_carries_a_model_card(tmp_path: Path, tiny_policy: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = load_config(
        overrides=[
            f"model.path={tiny_policy}", f"log.run_dir={run_dir}", "log.live=false",
            "log.tensorboard=false", "log.plots=false", "train.steps=4", "train.batch_size=4",
            "algo.critic_pretrain_steps=1", "rollout.in_flight=4", "rollout.max_new_tokens=4",
            "rollout.max_turns=1", "rollout.max_total_tokens=64", "eval.every=2",
            "eval.episodes=4", "log.checkpoint_every=100", "log.eval_samples=3",
        ]
    )  # fmt: skip
    train(cfg, task=SayATask())
    card = (run_dir / "final" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "# `calculator` policy trained with sao" in card  # cfg.task labels the own task
    assert "the `sao` algorithm preset: advantage `gae`, loss `dis`, a critic" in card
    assert "| steps | 5 of 5 (1 critic-only warm-up) |" in card  # 4 RL steps after 1 warm-up
    assert "| trajectories trained | 20 (4 per step) |" in card
    assert "stopped" not in card
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = {
        int(r["step"]): r["eval/success"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "eval/success" in r
    }
    assert sorted(evals) == [0, 2, 4, 5]  # the start, every 2 steps, the end
    best = min(s for s, v in evals.items() if v == summary["eval/success_best"])
    assert f"| first | 0 | {summary['eval/success_first']:.3f} |" in card
    assert f"| last | 5 | {summary['eval/success_last']:.3f} |" in card
    assert f"| best | {best} | {summary['eval/success_best']:.3f} |" in card
    assert card_yaml(card) == yaml.safe_load((run_dir / "config.yaml").read_text())
    assert not list((run_dir / "final").glob("*.tmp"))
    # each evaluation's first 3 of 4 episodes; the card quotes the last one's
    samples = [json.loads(x) for x in (run_dir / "eval_samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["index"]) for r in samples] == [
        (s, i) for s in (0, 2, 4, 5) for i in range(3)
    ]
    last = samples[-3:]
    assert "## What the replies look like" in card
    assert "The first 3 held-out episodes of the last evaluation (step 5; the run's" in card
    for r in last:
        assert f"Episode {r['index']}: reward {r['reward']:.3f}, `{r['finish_reason']}`" in card
        reply = r["reply"].strip() or f"(no visible text: {r['reply']!r})"
        assert f"```text\n{r['prompt'].strip()}\n```\n\n```text\n{reply}\n```" in card


def test_a_stopped_card_says_why_after_the_last_step() -> None:
    cfg = load_config(overrides=["train.steps=10", "algo.critic_pretrain_steps=0"])
    history = [{"step": 0.0, "eval/success": 0.5}, {"step": 1.0}, {"step": 2.0}]
    card = model_card(cfg, history, stopped="2 consecutive steps had NaN/inf values\n(hint)")
    assert (
        "**The run stopped early**, after step 2 of 10: 2 consecutive steps had NaN/inf "
        "values (hint)" in card
    )
    assert "| trajectories trained | 64 (32 per step) |" in card  # calc-tiny: batch 32
    assert "| first | 0 | 0.500 |" in card and "| best | 0 | 0.500 |" in card
    assert "No held-out evaluation" in model_card(cfg, [], stopped="x")
    assert "No held-out transcripts were recorded (`log.eval_samples`)" in card


def test_the_card_quotes_replies_in_fences_that_hold_them() -> None:
    cfg = load_config(overrides=["train.steps=10", "algo.critic_pretrain_steps=0"])
    reply = "answer -29\n```\nnot the end of the fence\n```"
    samples = [
        Transcript(9, i, f"user\nWhat is 16 - 45? ({i})", reply, 1.0, "stop") for i in range(5)
    ]
    card = model_card(cfg, [{"step": 9.0, "eval/success": 1.0}], samples=samples)
    assert "(step 9; the run's `eval_samples.jsonl` holds 5 of them):" in card
    assert "Episode 2: reward 1.000, `stop`" in card and "Episode 3:" not in card
    assert f"````text\n{reply}\n````" in card  # a fence one backtick longer than the reply's


def test_the_export_of_a_stopped_run_carries_a_card(tmp_path: Path, tiny_policy: Path) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(NonFiniteError):
        train(load_config(overrides=diverging(tiny_policy, run_dir)), task=SayATask())
    card = (run_dir / "final" / "README.md").read_text()
    assert "**The run stopped early**, after step 2 of 10: 2 consecutive steps" in card
    assert card_yaml(card)["train"]["actor_lr"] == 1e9
