"""Values that used to pass validation and fail later (with a traceback, a hang
or a half-made run directory) are config errors: ``sao train`` exits 2 with one
``sao: error:`` line naming the field, or the file and line of a syntax error,
and writes nothing."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from sao.config import (
    AlgoConfig,
    ConfigError,
    EvalConfig,
    ModelConfig,
    RuntimeConfig,
    TaskConfig,
    TrainConfig,
    load_config,
)
from tests.test_cli import QUIET, fails

SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelConfig,
    "task": TaskConfig,
    "algo": AlgoConfig,
    "train": TrainConfig,
    "runtime": RuntimeConfig,
    "eval": EvalConfig,
}


def train_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str
) -> str:
    """``sao train ARGS`` exits 2 with one line and leaves no run directory, named
    or default (runs/<task>-<preset>-<time> under the working directory)."""
    monkeypatch.chdir(tmp_path)
    err = fails(capsys, ["train", *args, *QUIET])
    named = tmp_path / "named"
    assert fails(capsys, ["train", *args, "--set", f"log.run_dir={named}", *QUIET]) == err
    assert not named.exists() and not (tmp_path / "runs").exists()
    return err


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("rollout.top_p=0", "rollout.top_p"),
        ("rollout.top_p=2", "rollout.top_p"),
        ("rollout.top_p=-0.5", "rollout.top_p"),
        ("rollout.top_p=.nan", "rollout.top_p"),
        ("rollout.top_k=-5", "rollout.top_k"),
    ],
)
def test_sampling_filters_out_of_range(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    override: str,
    field: str,
) -> None:
    assert f"{field}:" in train_fails(capsys, tmp_path, monkeypatch, "--set", override)


def test_sampling_filters_in_range_pass() -> None:
    cfg = load_config(overrides=["rollout.top_p=1e-3", "rollout.top_k=5"])
    assert (cfg.rollout.top_p, cfg.rollout.top_k) == (1e-3, 5)
    assert load_config(overrides=["rollout.top_p=1", "rollout.top_k=0"]).rollout.top_p == 1


def _is_float(annotation: object) -> bool:
    """``float``, a constrained float (``PositiveFloat``) or a union holding one."""
    if annotation is float:
        return True
    return any(_is_float(a) for a in typing.get_args(annotation))


FLOAT_FIELDS = [
    f"{name}.{key}"
    for name, section in SECTIONS.items()
    for key, field in section.model_fields.items()
    if _is_float(field.annotation)
]


def test_every_section_has_float_fields_to_check() -> None:
    assert {
        "train.actor_lr",
        "task.latency_max_s",
        "algo.eps_high",
        "runtime.cpus_per_rank",
    } <= set(FLOAT_FIELDS)


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1e400"])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_non_finite_numbers_are_rejected(field: str, value: str) -> None:
    """Every float field of these sections: inf passed every ``> 0`` check (an
    infinite learning rate, a sleep that never ends); nan fails some checks with
    a less clear message. 1e400 is YAML's inf."""
    with pytest.raises(ConfigError, match=rf"{field}: "):
        load_config(overrides=[f"{field}={value}"])


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("seed=-1", "seed: Input should be greater than or equal to 0"),  # numpy's range
        ("seed=4294967296", "seed: Input should be less than 4294967296"),
        ("algo.critic_pretrain_steps=-1", "algo.critic_pretrain_steps:"),
        ("algo.running_mean_window=0", "algo.running_mean_window:"),
        ("algo.eps_low=1.5", "algo.eps_low must be in (0, 1]"),
        ("model.tiny_size=7m", "model.tiny_size:"),
        ("runtime.gpus_per_worker=0.00001", "runtime.gpus_per_worker:"),
        ("runtime.cpus_per_rank=1e-6", "runtime.cpus_per_rank:"),
    ],
)
def test_values_that_failed_later_name_their_field(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    override: str,
    named: str,
) -> None:
    assert named in train_fails(capsys, tmp_path, monkeypatch, "--set", override)


def test_latency_cap_below_its_median(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["--set", "task.latency=lognormal", "--set", "task.latency_median_s=10"]
    err = train_fails(capsys, tmp_path, monkeypatch, *args)
    assert "latency_max_s (5.0) must be >= latency_median_s (10.0)" in err
    load_config(overrides=["task.latency_median_s=10"])  # no latency: nothing is capped


def test_tiny_sizes_are_the_models() -> None:
    from sao.models.tiny import TINY_SIZES

    sizes = typing.get_args(ModelConfig.model_fields["tiny_size"].annotation)
    assert sizes == tuple(TINY_SIZES)


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("bad.toml", "seed = 1\n[train]\nsteps = \n", ":3:9: invalid TOML: Invalid value"),
        ("bad.toml", "[train]\nsteps = 3\n[train]\n", ":3:7: invalid TOML: Cannot declare"),
        ("bad.yaml", "train:\n  steps: 3\n   batch_size: 4\n", ":3:14: invalid YAML: mapping"),
        ("bad.yml", "train: {steps: 3\n", ":2:1: invalid YAML"),
        ("bad.yaml", "seed: 1\n\tbad: tab\n", ":2:1: invalid YAML"),
    ],
)
def test_syntax_errors_name_the_file_and_line(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    text: str,
    where: str,
) -> None:
    path = tmp_path / name
    path.write_text(text)
    err = train_fails(capsys, tmp_path, monkeypatch, "--config", str(path))
    assert f"sao: error: {path}{where}" in err


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("keys.yaml", b"1: 2\n", "unknown config key '1'"),
        ("preset.yaml", b"preset: 3\n", "preset must be a name, one of calc-tiny"),
        ("latin1.yaml", b"seed: 1 # \xe9\n", "cannot be read as UTF-8 text"),
        ("list.toml", b"", None),  # an empty file is an empty table: valid
        ("list.yaml", b"- 1\n", "must hold a table of settings"),
    ],
)
def test_odd_files(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    content: bytes,
    message: str | None,
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    if message is None:
        load_config(file=path)
        return
    assert message in train_fails(capsys, tmp_path, monkeypatch, "--config", str(path))


def test_a_directory_is_not_a_config_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "conf").mkdir()
    err = train_fails(capsys, tmp_path, monkeypatch, "--config", str(tmp_path / "conf"))
    assert "is a directory, not a file" in err


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("train.steps=[1,", "--set 'train.steps=[1,': the value is not valid YAML"),
        ("train..steps=3", "the key has an empty part"),
        ("task=3", "task: Input should be a valid dictionary"),
    ],
)
def test_bad_set_items(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    item: str,
    message: str,
) -> None:
    assert message in train_fails(capsys, tmp_path, monkeypatch, "--set", item)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["model.lora.rnk=4"], "model.lora.rnk: Extra inputs are not permitted"),
        (["model.lora.dropout=0.1"], "model.lora.dropout: Value error, 0.1 is not supported"),
        (["model.lora.target_modules=[]"], "name at least one module"),
        (["model.lora.rank=0"], "model.lora.rank"),
        (
            [
                "model.lora.rank=4",
                "runtime.backend=ray",
                "rollout.engine=http",
                "rollout.lora_sync=adapter",
            ],
            "with runtime.backend=ray the trainer ranks send",
        ),
        (["model.lora.rank=4", "rollout.engine=sglang"], "rollout.engine=sglang"),
        (["rollout.lora_sync=adapter"], "model.lora is unset"),
        (["model.lora.rank=4", "rollout.lora_sync=adapter"], "rollout.engine=torch applies"),
        (
            [
                "model.lora.rank=4",
                "rollout.engine=vllm",
                "rollout.lora_sync=adapter",
                "rollout.weight_transfer=broadcast",
            ],
            "set rollout.weight_transfer=disk",
        ),
        (
            ["model.lora.rank=1024", "rollout.engine=vllm", "rollout.lora_sync=adapter"],
            "vLLM serves LoRA adapters up to rank 512",
        ),
        # known only once the model is loaded: still before anything is written
        (["model.lora.target_modules=[qproj]"], "model.lora: unknown target module(s) ['qproj']"),
        (["model.lora.rank=4096"], "model.lora: rank 4096 is larger than"),
        (["model.critic_lora.target_modules=[q_proj]"], "attention is frozen, so adapt MLP"),
    ],
)
def test_bad_lora_settings_fail_before_the_run(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    says: str,
) -> None:
    sets = [x for a in args for x in ("--set", a)]
    assert says in train_fails(capsys, tmp_path, monkeypatch, *sets)
