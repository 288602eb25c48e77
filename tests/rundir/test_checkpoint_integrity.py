"""Damaged checkpoints and logs: a manifest of every file's size and SHA-256
lets resume skip a truncated or corrupt checkpoint (falling back to the
previous one) instead of a traceback; older checkpoints without one are
accepted when they load; pruning keeps the newest ``log.keep_checkpoints``
without ever leaving a half-deleted one; a torn last line of a JSON-lines
log (a kill mid-write) is repaired; the ledger check catches what a bad
resume would do."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from sao.config import ConfigError
from sao.models.loading import load_policy
from sao.models.value import ValueModel
from sao.rundir import checkpoint as ckpt_mod
from sao.rundir.checkpoint import (
    begin_checkpoint,
    checkpoint_problem,
    finish_checkpoint,
    intact_checkpoint,
    latest_checkpoint,
    rewind_metrics,
)
from sao.rundir.ledger import check_ledger
from sao.rundir.manifest import MANIFEST, sha256_file
from sao.rundir.metrics import RunLogger, read_jsonl, repair_jsonl
from tests.rundir.test_checkpoint_resume import traj


def _save(root: Path, step: int, policy_dir: Path, *, keep: int = 0, sharded: bool = False) -> Path:
    """Checkpoint ``step``: policy and critic, two buffered trajectories, and
    (``sharded``) stand-ins for DCP files written by trainer ranks."""
    tmp = begin_checkpoint(root, step)
    load_policy(policy_dir).save_pretrained(tmp / "policy")
    ValueModel.from_policy(policy_dir, seed=0).save_pretrained(tmp / "critic")
    if sharded:
        (tmp / "sharded").mkdir()
        (tmp / "sharded" / ".metadata").write_bytes(b"dcp metadata")
        (tmp / "sharded" / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    return finish_checkpoint(
        root,
        step,
        tmp,
        trainer_state={"step": step},
        state={"version": step, "in_flight": [], "next_index": 4},
        trajectories=[traj(step), traj(step + 1)],
        keep=keep,
    )


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": _truncate,
    "corrupt": _flip,
    "missing": Path.unlink,
}


def test_manifest_lists_every_file_last(tmp_path: Path, tiny_policy: Path) -> None:
    path = _save(tmp_path, 2, tiny_policy, sharded=True)
    files = json.loads((path / MANIFEST).read_text())["files"]
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert set(files) == on_disk - {MANIFEST}
    assert {"trainer.pt", "state.json", "trajectories.jsonl", "sharded/__0_0.distcp"} <= set(files)
    assert {"policy/model.safetensors", "critic/model.safetensors"} <= set(files)
    for rel, entry in files.items():
        assert entry == {"size": (path / rel).stat().st_size, "sha256": sha256_file(path / rel)}
    assert checkpoint_problem(path) is None


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize(
    "name",
    [
        "trainer.pt",
        "policy/model.safetensors",
        "critic/model.safetensors",
        "state.json",
        "trajectories.jsonl",
        "sharded/__0_0.distcp",
        MANIFEST,
    ],
)
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(
    tmp_path: Path, tiny_policy: Path, name: str, damage: str
) -> None:
    first = _save(tmp_path, 2, tiny_policy, sharded=True)
    newest = _save(tmp_path, 4, tiny_policy, sharded=True)
    DAMAGE[damage](newest / name)
    said: list[str] = []
    if (name, damage) == (MANIFEST, "missing"):  # then it must load, and it does
        assert intact_checkpoint(tmp_path, said.append) == newest and not said
        return
    assert intact_checkpoint(tmp_path, said.append) == first
    (line,) = said
    assert line.startswith("resume: skipping damaged checkpoint step_000004: ")
    if name != MANIFEST:
        assert name in line
    assert "moved to .damaged_step_000004" in line
    assert not newest.exists() and (tmp_path / ".damaged_step_000004").is_dir()
    # the pointer still names the damaged one: latest_checkpoint falls back by itself
    assert latest_checkpoint(tmp_path) == first
    # training on from step 2 writes step 4 again, beside the damaged copy
    again = _save(tmp_path, 4, tiny_policy)
    assert intact_checkpoint(tmp_path, said.append) == again and len(said) == 1


def test_a_checkpoint_without_manifest_is_accepted_only_if_it_loads(
    tmp_path: Path, tiny_policy: Path
) -> None:
    first = _save(tmp_path, 2, tiny_policy)
    newest = _save(tmp_path, 4, tiny_policy)
    for path in (first, newest):  # as written before manifests existed
        (path / MANIFEST).unlink()
    assert checkpoint_problem(newest) is None
    assert intact_checkpoint(tmp_path) == newest
    _truncate(newest / "policy" / "model.safetensors")
    problem = checkpoint_problem(newest)
    assert problem is not None and "no manifest.json" in problem
    assert intact_checkpoint(tmp_path, lambda _: None) == first
    _truncate(first / "trainer.pt")
    with pytest.raises(ConfigError, match=r"every checkpoint .* is damaged \(step_000002, moved"):
        intact_checkpoint(tmp_path, lambda _: None)
    assert intact_checkpoint(tmp_path) is None  # moved aside: resuming again starts over


def test_keep_checkpoints_prunes_the_oldest(tmp_path: Path, tiny_policy: Path) -> None:
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, tiny_policy, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000003", "step_000004"]
    for step in (1, 2, 3):
        _save(tmp_path / "all", step, tiny_policy, keep=0)
    assert len(list((tmp_path / "all").glob("step_*"))) == 3


def test_a_crash_while_pruning_leaves_no_half_deleted_checkpoint(
    tmp_path: Path, tiny_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(tmp_path, 1, tiny_policy, keep=1)

    class Killed(BaseException):
        pass

    def crash_half_way(path: Path, ignore_errors: bool = False) -> None:
        if Path(path).exists():
            (Path(path) / "trainer.pt").unlink()  # part of it deleted, then killed
            raise Killed

    with monkeypatch.context() as m:
        m.setattr(ckpt_mod.shutil, "rmtree", crash_half_way)
        with pytest.raises(Killed):
            _save(tmp_path, 2, tiny_policy, keep=1)
    assert not (tmp_path / "step_000001").exists()
    assert [p.name[:21] for p in tmp_path.glob(".tmp_*")] == [".tmp_step_000001_old_"]
    assert latest_checkpoint(tmp_path) == intact_checkpoint(tmp_path) == tmp_path / "step_000002"
    _save(tmp_path, 3, tiny_policy, keep=1)  # the next save sweeps the leftover away
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000003"]


# ---------------------------------------------------------------------- logs


def _rows(*steps: int) -> str:
    return "".join(json.dumps({"step": s, "x": 0.5}) + "\n" for s in steps)


def test_a_torn_last_line_is_left_out_and_repaired(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(_rows(0, 1, 2) + '{"step": 3, "x": 0.')
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]
    assert [r["step"] for r in repair_jsonl(path)] == [0, 1, 2]
    assert path.read_text() == _rows(0, 1, 2)
    path.write_text(_rows(0, 1) + '{"step": 2, "x": 0.5}')  # only the newline was lost
    assert [r["step"] for r in repair_jsonl(path)] == [0, 1, 2]
    assert path.read_text() == _rows(0, 1, 2)
    path.write_text(_rows(0) + '{"step": 1, "x' + "\n" + _rows(2))
    with pytest.raises(ValueError, match=r"metrics\.jsonl line 2 is not JSON"):
        read_jsonl(path)
    assert read_jsonl(tmp_path / "none.jsonl") == []


def test_rewind_and_the_logger_repair_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(_rows(0, 1, 2, 3) + '{"step": 4, "x"')
    rewind_metrics(path, 2)
    assert path.read_text() == _rows(0, 1, 2)
    path.write_text(_rows(0, 1, 2) + '{"step": 3, "x"')
    logger = RunLogger(tmp_path, total_steps=5, tensorboard=False, live=False)
    assert [r["step"] for r in logger.history] == [0, 1, 2]
    logger.log(3, {"x": 0.5})
    logger.close()
    assert path.read_text() == _rows(0, 1, 2, 3)


# ---------------------------------------------------------------------- ledger


def _ledger(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _ckpt(step: int, buffered: list[int], restart: list[int], nxt: int) -> dict[str, object]:
    return {
        "event": "checkpoint",
        "step": step,
        "buffered": [f"train/{i}" for i in buffered],
        "restart": restart,
        "next_index": nxt,
        "rejected": 0,
    }


def _train(step: int, *ids: int) -> dict[str, object]:
    return {"event": "train", "step": step, "ids": [f"train/{i}" for i in ids], "rejected": 0}


def test_check_ledger_catches_double_training_and_loss(tmp_path: Path) -> None:
    start = {"event": "start", "step": 0}
    good = [start, _train(1, 0, 1), _ckpt(1, [2], [3], 4), _train(2, 2, 3), _ckpt(2, [4], [5], 6)]
    check = check_ledger(_ledger(tmp_path / "a.jsonl", good))
    assert check.problems == [] and (check.steps, check.trained, check.checkpoints) == (2, 4, 2)
    twice = [start, _train(1, 0, 1), _ckpt(1, [2], [3], 4), _train(2, 1, 3), _ckpt(2, [2], [], 4)]
    problems = check_ledger(_ledger(tmp_path / "b.jsonl", twice)).problems
    assert any("trained more than 1 times: ['train/1']" in p for p in problems)
    lost = [start, _train(1, 0, 1), _ckpt(1, [2], [3], 4), _train(2, 3, 4), _ckpt(2, [], [], 5)]
    problems = check_ledger(_ledger(tmp_path / "c.jsonl", lost)).problems
    assert any("buffered at checkpoint 1, never trained" in p for p in problems)
    assert any("started but lost" in p for p in problems)
    skipped = [start, _train(1, 0, 1), _train(3, 2, 3), _ckpt(3, [], [], 4)]
    assert "not 1..N" in check_ledger(_ledger(tmp_path / "d.jsonl", skipped)).problems[0]
