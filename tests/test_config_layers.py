"""Switching the algorithm in a later config source (a file over a preset,
``--set`` over both) must not keep the earlier algorithm's ``algo.*`` settings:
``smollm2-arith`` is GRPO in groups of 4, and ``--set algo=sao`` used to train
SAO in groups of 4 without a word."""

from __future__ import annotations

from pathlib import Path

import pytest

from sao.cli import main
from sao.config import load_config
from sao.config.resolve import resolve_config


def dropped_algo_settings(*args: object) -> dict[str, object]:
    return resolve_config(*args)[1]  # type: ignore[arg-type]


def test_switching_on_the_command_line_drops_the_presets_group_size() -> None:
    cfg = load_config("smollm2-arith", None, ["algo=sao"])
    algo = cfg.algo.resolve()
    assert (algo.name, algo.group_size, algo.use_critic) == ("sao", 1, True)
    assert dropped_algo_settings("smollm2-arith", None, ["algo=sao"]) == {"algo.group_size": 4}
    # the long spelling is the same switch
    assert load_config("smollm2-arith", None, ["algo.preset=sao"]).algo.resolve().group_size == 1


def test_the_switching_source_may_set_the_new_algorithms_fields() -> None:
    overrides = ["algo=sao", "algo.group_size=2", "algo.lam_actor=1"]
    algo = load_config("smollm2-arith", None, overrides).algo.resolve()
    assert (algo.group_size, algo.lam_actor) == (2, 1.0)
    # (set again in the same source: nothing was dropped that applies)
    assert dropped_algo_settings("smollm2-arith", None, overrides) == {}
    # the order of the --set items in one command line does not matter
    flipped = load_config("smollm2-arith", None, ["algo.group_size=2", "algo=sao"])
    assert flipped.algo.resolve().group_size == 2


def test_without_a_switch_earlier_settings_stay() -> None:
    for overrides in (["algo.eps_low=0.1"], ["algo=grpo", "algo.eps_low=0.1"]):
        algo = load_config("smollm2-arith", None, overrides).algo.resolve()
        assert (algo.name, algo.group_size, algo.eps_low) == ("grpo", 4, 0.1)
        assert dropped_algo_settings("smollm2-arith", None, overrides) == {}


def test_a_file_switch_drops_the_preset_and_a_command_line_switch_the_file(
    tmp_path: Path,
) -> None:
    f = tmp_path / "run.toml"
    f.write_text('preset = "smollm2-arith"\nalgo = "running_mean"\n')
    algo = load_config(None, f, []).algo.resolve()
    assert (algo.name, algo.group_size) == ("running_mean", 1)

    f.write_text('preset = "smollm2-arith"\n[algo]\npreset = "rloo"\ngroup_size = 8\n')
    algo = load_config(None, f, []).algo.resolve()
    assert (algo.name, algo.group_size) == ("rloo", 8)  # the file's own setting applies
    algo = load_config(None, f, ["algo=sao"]).algo.resolve()
    assert (algo.name, algo.group_size) == ("sao", 1)
    assert dropped_algo_settings(None, f, ["algo=sao"]) == {"algo.group_size": 8}


def test_a_preset_without_an_algo_is_sao() -> None:
    # calc-tiny names no algorithm: SAO. Saying so again drops nothing, and a switch
    # away from it keeps the same source's settings.
    assert dropped_algo_settings("calc-tiny", None, ["algo=sao", "algo.critic_steps=3"]) == {}
    algo = load_config("calc-tiny", None, ["algo=grpo", "algo.group_size=4"]).algo.resolve()
    assert (algo.name, algo.group_size) == ("grpo", 4)


def test_sao_config_says_what_it_dropped(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--preset", "smollm2-arith", "--set", "algo=sao"]) == 0
    out, err = capsys.readouterr()
    assert "group_size: null" in out
    assert "algo.group_size=4" in err and "'sao'" in err
    assert main(["config", "--preset", "smollm2-arith"]) == 0
    assert capsys.readouterr().err == ""


def test_the_qwen_presets_differ_from_smollm2s_where_they_say() -> None:
    # qwen-guess is smollm2-guess's task on the second family: same task and rollout
    # budget, its own model, bfloat16 weights (float32 masters), a lower LR and
    # activation checkpointing; its SAO preset trains the critic's top 4 layers.
    qwen, smol = load_config("qwen-guess"), load_config("smollm2-guess")
    assert qwen.task == smol.task and qwen.rollout == smol.rollout
    assert (qwen.model.path, qwen.model.dtype) == ("qwen2.5-coder-0.5b", "bfloat16")
    assert (qwen.train.actor_lr, qwen.train.activation_checkpointing) == (1e-6, True)
    sao = load_config("qwen-guess-sao")
    algo = sao.algo.resolve()
    assert (algo.name, algo.critic_train_layers, algo.critic_pretrain_steps) == ("sao", 4, 4)
    assert (sao.train.steps, sao.train.batch_size, sao.model) == (26, 16, qwen.model)
