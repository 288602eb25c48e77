"""LoRA end to end: a run whose actor and critic train adapters only raises
reward through the embedded engine (each update copies in only the adapted
modules' merged weights) and through `sao serve` (each update sends only the
adapters, which the server merges itself), saves adapters in its checkpoints, resumes from
them, and exports a merged model with its adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sao.app.run import train
from sao.config import ConfigError, load_config
from sao.models.loading import load_policy
from sao.models.lora import adapter_base, has_lora
from tests.train.test_learning import SayATask, _reward_gain, run

LORA = (
    "model.lora.rank=8",
    "model.lora.alpha=16",
    "model.critic_lora.rank=8",
    "train.actor_lr=1e-2",  # ~3x the full-parameter rate (3e-3); at 3e-2 it diverges
    "train.critic_lr=1e-2",
)


def _learned(history: list[dict[str, float]]) -> None:
    """Greedy held-out success from 0 to at least 0.75, and sampled reward up by
    0.1 (measured 0 -> 1.0 and ~0.1 -> ~0.3, where full fine-tuning of this 0.1M
    model reaches ~0.9 sampled: the adapters move its greedy choice sooner
    than they sharpen its sampling distribution)."""
    evals = [r["eval/success"] for r in history if "eval/success" in r]
    assert evals[0] <= 0.25 and evals[-1] >= 0.75, evals
    first, last = _reward_gain(history)
    assert last > first + 0.1, (first, last)


@pytest.mark.slow
def test_sao_with_lora_raises_reward_and_exports_merged_and_adapter(
    tmp_path: Path, tiny_policy: Path
) -> None:
    history = run(tmp_path, tiny_policy, "algo=sao", "algo.critic_pretrain_steps=2", *LORA)
    _learned(history)
    # (the engine's log-probs against the trainer's: the run's start-up check, 1e-4;
    # how many stale tokens DIS masks depends on timing at this LR, so it is not asserted)
    assert all("dis/masked_frac" in r for r in history[3:])
    final = tmp_path / "run" / "final"
    assert adapter_base(final / "adapter") == str(tiny_policy)
    assert not has_lora(load_policy(final))  # a plain Hugging Face model, merged
    ckpt = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1]
    assert (ckpt / "policy" / "adapter_model.safetensors").is_file()
    assert not (ckpt / "policy" / "model.safetensors").exists()  # the base is not copied
    assert (ckpt / "critic" / "adapter" / "trained_base.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("transfer", ["disk", "broadcast"])
def test_lora_through_sao_serve_sends_only_the_adapters(
    tmp_path: Path, tiny_policy: Path, transfer: str
) -> None:
    """Through the weight directory the adapters alone travel (A and B); a
    broadcast sends the adapted modules' merged weights (with k_proj, the
    fused-qkv rule), and nothing goes through the filesystem."""
    history = run(
        tmp_path,
        tiny_policy,
        "algo=grpo",
        "algo.group_size=4",
        "rollout.engine=http",
        "rollout.launch=1",
        f"rollout.weight_transfer={transfer}",
        "model.lora.rank=8",
        "model.lora.target_modules=[q_proj, v_proj, down_proj]",
        "train.actor_lr=1e-2",
    )
    _learned(history)
    if transfer == "broadcast":
        assert not (tmp_path / "run" / "weights").exists()
        return
    newest = sorted((tmp_path / "run" / "weights").iterdir())[-1]
    meta = json.loads((newest / "sao_weights.json").read_text())
    # sao serve merges the factors itself: only A and B of the adapted modules travel
    assert {n.rsplit(".", 2)[-2:][0] for n in meta["names"]} == {"q_proj", "v_proj", "down_proj"}
    assert {n.rsplit(".", 1)[-1] for n in meta["names"]} == {"lora_A", "lora_B"}
    assert set(meta["adapter"]["scaling"].values()) == {16 / 8}


def test_resume_refuses_an_adapter_of_another_base(tmp_path: Path, tiny_policy: Path) -> None:
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_policy, other)
    cfg = load_config(
        overrides=[
            f"model.path={tiny_policy}",
            f"log.run_dir={tmp_path / 'run'}",
            "log.live=false",
            "log.tensorboard=false",
            "log.plots=false",
            "train.steps=2",
            "train.batch_size=4",
            "rollout.in_flight=4",
            "rollout.max_new_tokens=4",
            "rollout.max_turns=1",
            "rollout.max_total_tokens=64",
            "eval.every=100",
            "eval.episodes=4",
            "log.checkpoint_every=1",
            "algo=grpo",
            "algo.group_size=2",
            "model.lora.rank=4",
        ]
    )
    run_dir = train(cfg, task=SayATask())
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    from sao.app.parts import load_trained_policy

    moved = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(other)})})
    import torch

    with pytest.raises(ConfigError, match=r"model\.lora: the adapter .* was trained on base"):
        load_trained_policy(moved, ckpt, torch.device("cpu"), torch.float32)
    policy = load_trained_policy(cfg, ckpt, torch.device("cpu"), torch.float32)
    assert has_lora(policy)
