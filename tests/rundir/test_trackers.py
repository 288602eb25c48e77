"""Experiment trackers, read back from their local files: Weights & Biases in
offline mode (``WANDB_MODE=offline``) and MLflow's file store under the run
directory. Each is skipped when its package is not installed."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from sao.app.run import train
from sao.config import load_config, to_dict
from sao.rundir.metrics import RunLogger
from tests.train.test_learning import SayATask

CONFIG: dict[str, object] = {"train": {"steps": 3, "actor_lr": 0.001}, "task": {"options": {}}}


def log_three_steps(logger: RunLogger) -> None:
    for step in (1, 2, 3):
        logger.log(step, {"train/reward_mean": step / 10, "critic/loss": float("nan")})


def wandb_records(path: Path) -> list[Any]:
    """The protobuf records of an offline run's ``run-*.wandb`` file. wandb 0.2x
    dropped its Python reader (the Go core writes the file); the format is
    LevelDB's log: a 7-byte header, then 32 KiB blocks of chunks, each
    ``crc32 (4) | length (2, little-endian) | type (1: full, 2: first,
    3: middle, 4: last)`` and its bytes."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, pos, chunks = [], 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks, pos = chunks + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def finished_records(path: Path, timeout_s: float = 60.0) -> list[Any]:
    """The records once the run's ``exit`` record is in the file: ``finish()``
    can return while wandb's core process is still writing it (measured here:
    1 in 12 runs found only the 7-byte header, complete 0.25 s later)."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = wandb_records(path)
        except (DecodeError, struct.error):  # a record still being written
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s"
        time.sleep(0.1)


def _key(item: Any) -> str:
    """An item's name: ``key``, or its ``nested_key`` parts (which wandb writes instead)."""
    return item.key or ".".join(item.nested_key)


def test_wandb_offline_run_holds_the_metrics_and_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (pip install sao[wandb])")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing in ~
        monkeypatch.setenv(name, str(tmp_path / "home"))
    with RunLogger(tmp_path, total_steps=3, tensorboard=False, wandb_project="t", config=CONFIG,
                   print_every=0) as logger:  # fmt: skip
        log_three_steps(logger)
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = finished_records(path)
    rows = [
        {_key(item): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(r["_step"], r["train/reward_mean"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    config = {
        _key(item): json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "run"
        for item in r.run.config.update
    }
    assert config["train"] == {"steps": 3, "actor_lr": 0.001}


def test_wandb_offline_run_holds_the_eval_samples_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (pip install sao[wandb])")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing in ~
        monkeypatch.setenv(name, str(tmp_path / "home"))
    rows: list[dict[str, object]] = [
        {"step": 2, "index": 0, "prompt": "What is 16 - 45?", "reply": "answer -29",
         "reward": 1.0, "finish_reason": "stop", "error": None},
        {"step": 2, "index": 1, "prompt": "What is 2 + 3?", "reply": "2 + 3",
         "reward": 0.0, "finish_reason": "stop", "error": None},
    ]  # fmt: skip
    with RunLogger(tmp_path, total_steps=3, tensorboard=False, wandb_project="t", config=CONFIG,
                   print_every=0) as logger:  # fmt: skip
        logger.log(1, {"train/reward_mean": 0.1})
        logger.table("eval/samples", 2, rows)  # before the step's metrics, as a run does
        logger.log(2, {"train/reward_mean": 0.2, "eval/success": 0.5})
        logger.table("eval/samples", 3, [])  # nothing to log
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    history = [
        {_key(item): json.loads(item.value_json) for item in r.history.item}
        for r in finished_records(next(run.glob("run-*.wandb")))
        if r.WhichOneof("record_type") == "history"
    ]
    assert [r["_step"] for r in history] == [1, 2]
    step2 = history[1]  # wandb writes the table's fields as nested keys
    assert step2["eval/samples._type"] == "table-file" and step2["eval/samples.nrows"] == 2
    assert step2["eval/success"] == 0.5  # merged into the same step
    (saved,) = (run / "files").rglob("*.table.json")
    data = json.loads(saved.read_text())
    assert data["columns"] == list(rows[0])
    assert data["data"] == [list(r.values()) for r in rows]


@pytest.fixture
def mlflow_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No tracking server; and MLFLOW_ALLOW_FILE_STORE, which the logger sets
    when it is unset, is unset again afterwards (setenv records it as absent)."""
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install sao[mlflow])")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")


def mlflow_run(uri: str, experiment: str = "sao") -> tuple[Any, Any]:
    """The client of ``uri`` and the one run of ``experiment`` there."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None
    (run,) = client.search_runs([found.experiment_id])
    return client, run


@pytest.mark.usefixtures("mlflow_env")
def test_mlflow_logs_params_and_metrics_under_the_run_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "run-a"
    run_dir.mkdir()
    logger = RunLogger(run_dir, total_steps=3, tensorboard=False, mlflow_experiment="sao",
                       config=CONFIG, print_every=0)  # fmt: skip
    log_three_steps(logger)
    logger.close()
    client, run = mlflow_run((run_dir / "mlruns").as_uri())
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    params = run.data.params
    assert params == {"train.steps": "3", "train.actor_lr": "0.001", "task.options": "{}"}
    history = client.get_metric_history(run.info.run_id, "train/reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert "critic/loss" not in run.data.metrics  # NaN: left out


@pytest.mark.usefixtures("mlflow_env")
def test_mlflow_goes_to_the_tracking_uri_when_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = (tmp_path / "server").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store as the "server"
    with pytest.raises(RuntimeError, match="boom"):  # noqa: SIM117
        with RunLogger(tmp_path, total_steps=3, tensorboard=False, mlflow_experiment="exp",
                       print_every=0) as logger:  # fmt: skip
            log_three_steps(logger)
            raise RuntimeError("boom")
    assert not (tmp_path / "mlruns").exists()
    _, run = mlflow_run(uri, "exp")
    assert run.info.status == "FAILED"


@pytest.mark.usefixtures("mlflow_env")
def test_sao_train_with_log_mlflow(tmp_path: Path, tiny_policy: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = load_config(
        overrides=[
            f"model.path={tiny_policy}", f"log.run_dir={run_dir}", "log.live=false",
            "log.tensorboard=false", "log.plots=false", "train.steps=2", "train.batch_size=4",
            "algo.critic_pretrain_steps=0", "rollout.in_flight=4", "rollout.max_new_tokens=4",
            "rollout.max_turns=1", "rollout.max_total_tokens=64", "eval.episodes=2",
            "log.mlflow=true",
        ]
    )  # fmt: skip
    train(cfg, task=SayATask())
    client, run = mlflow_run((run_dir / "mlruns").as_uri())
    assert run.data.params["train.steps"] == "2"
    assert run.data.params["log.mlflow"] == "true"
    assert len(run.data.params) == len(_leaves(to_dict(cfg)))
    steps = client.get_metric_history(run.info.run_id, "eval/success")
    assert [m.step for m in steps] == [0, 2]


def _leaves(d: dict[str, object]) -> list[object]:
    return [x for v in d.values() for x in (_leaves(v) if isinstance(v, dict) and v else [v])]
