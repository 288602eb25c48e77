"""The ``sao`` command on bad input: one clear ``sao: error:`` line, exit 2,
no traceback, and no half-written run directory left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import sao.app.run
import sao.app.warmstart
from sao.cli import main
from sao.config import Config, load_config, to_dict

QUIET = ["--set", "log.live=false", "--set", "log.tensorboard=false", "--set", "log.plots=false"]


def fails(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``sao argv``; assert exit 2 with one ``sao: error:`` line; return it."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sao: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_unknown_key_names_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(capsys, ["config", "--set", "train.stpes=3"])
    assert "'train.stpes'" in err and "Did you mean 'train.steps'?" in err
    err = fails(capsys, ["config", "--set", "trian.steps=3"])
    assert "Did you mean 'train'?" in err


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("train.steps=abc", "train.steps"),
        ("model.dtype=float16", "model.dtype"),
        ("algo=nope", "algo"),
        ("train.steps", "key=value"),
    ],
)
def test_bad_value_names_the_field(
    capsys: pytest.CaptureFixture[str], override: str, field: str
) -> None:
    assert field in fails(capsys, ["config", "--set", override])


def test_unknown_preset_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["config", "--preset", "calc-huge"])
    assert exc.value.code == 2
    assert "calc-tiny" in capsys.readouterr().err


def test_unknown_task_lists_the_valid_ones(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    err = fails(capsys, ["train", "--set", "task.name=calculater", "--set", f"log.run_dir={run}"])
    for name in ("calculator", "guess_number", "python_tool"):
        assert name in err
    assert "Did you mean 'calculator'?" in err
    assert not run.exists()


def test_missing_model_path_leaves_no_run_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the default run directory is runs/<task>-<preset>-<time>
    err = fails(capsys, ["train", "--set", "model.path=/nonexistent", *QUIET])
    assert "'/nonexistent'" in err and "does not exist" in err
    assert not any((tmp_path / "runs").glob("*"))
    run = tmp_path / "named"
    fails(capsys, ["train", "--set", "model.path=/nonexistent", "--set", f"log.run_dir={run}"])
    assert not run.exists()


def test_occupied_run_directory_points_to_resume(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_policy: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    argv = ["train", "--set", f"model.path={tiny_policy}", "--set", f"log.run_dir={run}", *QUIET]
    err = fails(capsys, argv)
    assert "already holds a run" in err and f"--resume {run}" in err
    assert (run / "config.yaml").read_text() == "seed: 0\n"  # the other run is untouched
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]


def test_config_prints_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--preset", "guess-tiny", "--set", "train.steps=7"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["train"]["steps"] == 7 and data["task"]["name"] == "guess_number"
    assert load_config("guess-tiny", None, ["train.steps=7"]) == Config.model_validate(data)


def test_config_reference_prints_markdown(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--reference"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Configuration reference\n")
    assert "| `train.steps` |" in out and "## `train`" in out


def _saved_run(tmp_path: Path, policy: Path) -> Path:
    """A run directory holding only the config a run was started with."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config("guess-tiny", None, [f"model.path={policy}", f"log.run_dir={run}"])
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return run


def test_resume_applies_set_overrides(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    tiny_policy: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = _saved_run(tmp_path, tiny_policy)
    seen: list[tuple[Config, Path | None]] = []

    def fake_train(cfg: Config, *, resume: Path | None = None) -> Path:
        seen.append((cfg, resume))
        summary = {f"eval/success_{k}": 0.5 for k in ("first", "last", "best")}
        (run / "summary.json").write_text(json.dumps(summary))
        return run

    monkeypatch.setattr(sao.app.run, "train", fake_train)
    assert main(["train", "--resume", str(run), "--set", "train.steps=9"]) == 0
    ((cfg, resume),) = seen
    assert resume == run and cfg.train.steps == 9
    saved = load_config("guess-tiny", None, [f"model.path={tiny_policy}", f"log.run_dir={run}"])
    assert cfg == saved.model_copy(update={"train": saved.train.model_copy(update={"steps": 9})})
    assert f"run directory: {run}" in capsys.readouterr().out


def test_resume_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_policy: Path
) -> None:
    err = fails(capsys, ["train", "--resume", str(tmp_path / "nowhere")])
    assert "not a run directory" in err
    run = _saved_run(tmp_path, tiny_policy)
    assert "--set" in fails(capsys, ["train", "--resume", str(run), "--preset", "calc-tiny"])
    err = fails(capsys, ["train", "--resume", str(run), "--set", "train.actor_lr=0.5"])
    assert "train.actor_lr" in err
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]  # nothing written


def test_a_diverged_run_stops_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sao.train.guard import NonFiniteError

    def diverge(cfg: Config, *, resume: Path | None = None) -> Path:
        raise NonFiniteError("3 consecutive steps had a NaN/inf loss or gradient; stopping")

    monkeypatch.setattr(sao.app.run, "train", diverge)
    assert main(["train", *QUIET]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sao: stopped: 3 consecutive steps") and "Traceback" not in err


def test_real_bugs_are_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    def bug(cfg: Config, *, resume: Path | None = None) -> Path:
        raise ValueError("an internal bug")

    monkeypatch.setattr(sao.app.run, "train", bug)
    with pytest.raises(ValueError, match="internal bug"):
        main(["train", *QUIET])


def test_another_task_does_not_inherit_the_presets_task_options() -> None:
    from sao.config import load_config

    assert load_config().task.options["ops_per_call"] == 2  # calc-tiny's calculator options
    cfg = load_config(overrides=["task.name=dataset", "task.options.path=x.jsonl"])
    assert cfg.task.options == {"path": "x.jsonl"}
    assert cfg.train.steps == 100  # the rest of the preset still applies


def test_eval_show_prints_transcripts_before_the_json_line(
    tiny_policy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    task = ["--set", "task.name=guess_number", "--set", "rollout.max_new_tokens=4"]
    assert main(["eval", str(tiny_policy), "--episodes", "3", "--show", "2", *task]) == 0
    lines = capsys.readouterr().out.splitlines()
    result = json.loads(lines[-1])  # the JSON line stays last
    assert result["task"] == "guess_number" and 0.0 <= result["eval/success"] <= 1.0
    headers = [x for x in lines if x.startswith("eval sample ")]
    assert [h.split(":")[0] for h in headers] == ["eval sample 0", "eval sample 1"]
    assert lines[1] == "  prompt:" and "  reply:" in lines
    assert main(["eval", str(tiny_policy), "--episodes", "1", *task]) == 0
    assert not [x for x in capsys.readouterr().out.splitlines() if x.startswith("eval sample")]
    assert "--show -1: use 0 or more" in fails(capsys, ["eval", str(tiny_policy), "--show", "-1"])


def test_eval_sizes_the_kv_cache_by_the_episode_budget(
    tiny_policy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the model's positions (4096 for SmolLM2-135M) made a 64-slot cache of 11 GiB
    sizes: list[int] = []
    real = sao.app.warmstart.TorchEngine

    def recording(*args: object, **kw: object) -> object:
        engine = real(*args, **kw)  # type: ignore[arg-type]
        sizes.append(engine.max_seq_len)
        return engine

    monkeypatch.setattr(sao.app.warmstart, "TorchEngine", recording)
    task = ["--set", "task.name=guess_number", "--set", "rollout.max_total_tokens=96"]
    assert main(["eval", str(tiny_policy), "--episodes", "1", *task]) == 0
    assert sizes == [96]


def test_check_takes_at_most_the_held_out_set(
    tiny_policy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # more episodes than the held-out set holds were a bare IndexError on a dataset
    # task, and on guess_number problems past the held-out set
    argv = ["check", "--set", f"model.path={tiny_policy}", "--set", "task.name=guess_number"]
    argv += ["--set", "task.options.eval_size=2", "--set", "rollout.max_new_tokens=4"]
    assert main([*argv, "--episodes", "50"]) == 0
    out = capsys.readouterr().out
    (report,) = [x for x in out.splitlines() if x.startswith("torch engine: ")]
    assert report.endswith(" in 2 episodes (budget: max 0.0001)"), out  # float32: 1e-4
    assert "--episodes 0: use 1 or more" in fails(capsys, [*argv, "--episodes", "0"])
