"""The one-GPU recipe (recipes/qwen3-0.6b-math.toml) runs end to end on the CPU:
the same file, a tiny random Qwen3 in place of Qwen3-0.6B, a four-problem
JSONL dataset, and ``--set`` overrides that only shrink sizes and move it to
the CPU in float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sao.app.parts import build_parts
from sao.app.run import train
from sao.config import ConfigError, load_config, read_file
from sao.models.loading import load_policy
from sao.models.tiny import build_tiny_policy
from sao.models.tokenization import build_char_tokenizer

pytest.importorskip("math_verify")

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "qwen3-0.6b-math.toml"
PROBLEMS = [
    ("What is 1/4 + 1/4?", "\\frac{1}{2}"),
    ("What is 2 + 3?", "5"),
    ("What is 7 - 4?", "3"),
    ("What is 2 * 4?", "8"),
]  # the start-up log-prob check plays 4 eval problems
SHRINK = [  # sizes only; everything else is the recipe's
    "model.device=cpu",
    "model.dtype=float32",
    "algo.critic_pretrain_steps=1",
    "train.steps=1",
    "train.batch_size=2",
    "rollout.in_flight=2",
    "rollout.max_batch_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_total_tokens=256",
    "eval.episodes=2",
    "log.live=false",
    "log.tensorboard=false",
    "log.plots=false",
]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3ForCausalLM of the recipe's architecture, at 0.1M parameters."""
    path = tmp_path_factory.mktemp("qwen3")
    tokenizer = build_char_tokenizer()
    build_tiny_policy(tokenizer, arch="qwen3", size="0.1m", seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    path = tmp_path / "math.jsonl"
    rows = [{"problem": p, "answer": a} for p, a in PROBLEMS]  # the recipe's keys
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def overrides(model: Path, data: Path, run_dir: Path) -> list[str]:
    return [
        f"model.path={model}",
        f"task.options.train_path={data}",
        f"task.options.eval_path={data}",
        f"log.run_dir={run_dir}",
        *SHRINK,
    ]


def test_recipe_is_the_documented_gpu_setup() -> None:
    raw = read_file(RECIPE)
    assert raw["model"] | {"path": None} == {"path": None, "device": "cuda", "dtype": "bfloat16"}
    cfg = load_config(file=RECIPE)
    assert cfg.task.name == "dataset" and cfg.task.options["scorer"] == "math"
    assert cfg.algo.preset == "sao" and cfg.train.actor_lr < cfg.train.critic_lr
    assert 32 <= cfg.train.batch_size <= 128 and 1024 <= cfg.rollout.max_new_tokens <= 2048


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_recipe_without_a_gpu_says_what_to_set(tiny_qwen3: Path) -> None:
    cfg = load_config(file=RECIPE, overrides=[f"model.path={tiny_qwen3}"])
    with pytest.raises(ConfigError, match=r"model\.device='cuda' but no CUDA device.*=cpu"):
        build_parts(cfg)


def test_recipe_builds_on_the_resolved_device(tiny_qwen3: Path, data: Path, tmp_path: Path) -> None:
    cfg = load_config(file=RECIPE, overrides=overrides(tiny_qwen3, data, tmp_path / "run"))
    parts = build_parts(cfg)
    assert type(parts.policy).__name__ == "Qwen3ForCausalLM"
    assert parts.device == torch.device("cpu") and parts.trainer.device == parts.device
    assert parts.critic is not None
    models = (parts.policy, parts.critic)
    assert {p.dtype for m in models for p in m.parameters()} == {torch.float32}


def test_recipe_trains_two_steps_end_to_end(tiny_qwen3: Path, data: Path, tmp_path: Path) -> None:
    cfg = load_config(file=RECIPE, overrides=overrides(tiny_qwen3, data, tmp_path / "run"))
    run_dir = train(cfg)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # eval, critic warm-up step, actor step
    assert "critic/loss" in rows[1] and "actor/grad_norm" in rows[2]
    assert type(load_policy(run_dir / "final")).__name__ == "Qwen3ForCausalLM"
