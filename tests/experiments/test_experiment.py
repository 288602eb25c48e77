"""``sao experiment``: the interval arithmetic by hand, bad input, and a tiny
grid (2 arms x 2 seeds x 2 steps) that runs, resumes, and whose report is
rebuilt byte for byte from its run directories, and from a copy of the report
alone on another machine."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from sao.cli import main
from sao.config import ConfigError
from sao.experiments.grid import Experiment, claim_dir, load_grid, plan
from sao.experiments.named import EXPERIMENTS, get_experiment
from sao.experiments.report import (
    RunResult,
    Stats,
    code_md,
    collapse_step,
    t_critical,
    trailing_mean,
)
from sao.experiments.runner import code_version

# ---------------------------------------------------------------------- arithmetic


def test_the_report_says_which_code_the_runs_ran() -> None:
    def run(arm: str, seed: int, *code: str) -> RunResult:
        return RunResult(arm, seed, 2, 4, 0, 0.1, 0.2, 0.2, 0.3, None, 1.0, code=code)

    assert code_md([run("sao", 0)]) == []  # recorded by no run (made before it was)
    same = code_md([run("sao", 0, "sao 0.1.0 + git abc"), run("grpo", 0, "sao 0.1.0 + git abc")])
    assert same == ["", "Code: every run ran `sao 0.1.0 + git abc`."]
    mixed = code_md(
        [run("sao", 0, "A", "B-dirty"), run("sao", 1, "A"), run("grpo", 0)]
    )  # sao seed 0 was resumed on other (uncommitted) code; grpo's attempts predate the record
    assert mixed == [
        "",
        "**The runs did not all run the same code**: `A` (sao/0, sao/1); `B-dirty` (sao/0); "
        "not recorded: grpo/0.",
    ]
    # this checkout is a git clone: the package version and its commit
    assert re.fullmatch(r"sao \S+( \+ git [0-9a-f]{7,}(-dirty)?)?", code_version())


def test_mean_std_and_95_interval_by_hand() -> None:
    # x = 0.4, 0.5, 0.9: mean = 1.8 / 3 = 0.6
    # deviations -0.2, -0.1, 0.3; squares 0.04 + 0.01 + 0.09 = 0.14
    # sample variance 0.14 / (3 - 1) = 0.07, std = sqrt(0.07) = 0.264575
    # standard error 0.264575 / sqrt(3) = 0.152753; t_{0.975, 2} = 4.3027
    # half-width 4.3027 * 0.152753 = 0.657251 -> [-0.057251, 1.257251]
    s = Stats.of([0.4, 0.5, 0.9])
    assert s.n == 3
    assert s.mean == pytest.approx(0.6)
    assert s.std == pytest.approx(0.264575, abs=1e-6)
    assert s.low == pytest.approx(-0.057251, abs=1e-5)
    assert s.high == pytest.approx(1.257251, abs=1e-5)
    assert s.cell() == "0.600 ± 0.265 [-0.057, 1.257]"
    one = Stats.of([0.7, float("nan")])  # NaN (a run without evals) is left out
    assert one.n == 1 and one.mean == 0.7 and math.isnan(one.std)
    assert one.cell() == "0.700 (one seed)" and Stats.of([]).cell() == "n/a"


def test_sign_test_and_paired_differences_by_hand() -> None:
    from sao.experiments.results import Paired, sign_test

    # 3 of 3 positive: P(X <= 0) = 1/8, two-sided 2/8
    assert sign_test([0.1, 0.2, 0.05]) == 0.25
    # 5 of 6 positive, a zero dropped: P(X <= 1) = (1 + 6) / 64, two-sided 14/64
    assert sign_test([1, 1, 1, 1, 1, -1, 0]) == pytest.approx(14 / 64)
    assert sign_test([0.0, 0.0]) == 1.0 and sign_test([]) == 1.0
    # seeds 0, 1, 2 in common (seed 3 only in A, seed 4 NaN in B): diffs 0.1, 0.2, 0.3,
    # mean 0.2, std 0.1, half-width 4.3027 * 0.1 / sqrt(3) = 0.2484: [-0.048, 0.448]
    a = {0: 0.5, 1: 0.6, 2: 0.7, 3: 0.9, 4: 0.1}
    b = {0: 0.4, 1: 0.4, 2: 0.4, 4: math.nan}
    pair = Paired.of(a, b)
    assert pair.seeds == (0, 1, 2) and pair.diffs == pytest.approx((0.1, 0.2, 0.3))
    assert pair.stats.low == pytest.approx(0.2 - 0.24841, abs=1e-4)
    assert pair.verdict() == "not separated at 3 seeds" and pair.p_sign == 0.25
    assert Paired.of({0: 0.5, 1: 0.6, 2: 0.55}, {0: 0.3, 1: 0.35, 2: 0.3}).verdict() == "A > B"
    assert Paired.of({0: 0.1, 1: 0.1}, {0: 0.3, 1: 0.32}).verdict() == "A < B"
    assert Paired.of({0: 0.1}, {0: 0.3}).verdict() == "one seed"


def test_t_critical_values() -> None:
    assert t_critical(1) == 12.7062 and t_critical(30) == 2.0423
    assert t_critical(40) == pytest.approx(2.0211, abs=1e-3)  # tables: 2.0211
    assert t_critical(120) == pytest.approx(1.9799, abs=1e-3)  # tables: 1.9799
    with pytest.raises(ValueError):
        t_critical(0)


def test_collapse_step_is_the_start_of_the_last_stretch_below_half() -> None:
    # initial 0.6, threshold 0.3: 10 is below, 20 recovers, from 30 on below for good
    evals = [(0, 0.6), (10, 0.2), (20, 0.4), (30, 0.29), (40, 0.1)]
    assert collapse_step(evals) == 30
    assert collapse_step(evals[:3]) is None  # recovered at the last eval
    assert collapse_step([(0, 0.0), (10, 0.0)]) is None  # nothing to fall from
    assert collapse_step([]) is None
    # a preference switch at step 25: only 0, 10, 20 count; 20 recovered
    assert collapse_step(evals, until=25) is None
    assert collapse_step(evals, until=35) == 30  # 30 is before the switch: kept


def test_minutes_to_gain_reads_the_first_evaluation_20_points_up() -> None:
    from sao.experiments.results import gain_cell as _to_gain
    from sao.experiments.results import minutes_to_gain

    def run(evals: list[tuple[int, float]], wall: list[tuple[int, float]]) -> RunResult:
        curves = {"eval/success": evals, "eval/wall_s": wall}
        first, last = evals[0][1], evals[-1][1]
        return RunResult("sao", 0, 30, 16, 4, first, last, 0.7, 0.5, None, 1.0, curves)

    wall = [(-4, 0.0), (6, 300.0), (16, 660.0), (26, 1020.0)]
    # initial 0.25: +0.20 is 0.45; 0.44 at step 6 is short, 0.45 at step 16 reaches it
    reached = run([(-4, 0.25), (6, 0.44), (16, 0.45), (26, 0.60)], wall)
    assert minutes_to_gain(reached) == 11.0  # 660 s
    never = run([(-4, 0.25), (6, 0.40), (16, 0.30), (26, 0.44)], wall)
    assert minutes_to_gain(never) is None
    assert minutes_to_gain(run([(-4, 0.25), (6, 0.9)], [])) is None  # no times logged
    early = run([(-4, 0.1), (6, 0.5), (16, 0.2), (26, 0.2)], wall)  # 5 min, then lost
    # the arm's cell: the mean over the runs that got there (11 and 5), 2 of 3 did
    assert _to_gain([reached, never, early]) == "8.0 (2/3)"
    assert _to_gain([run([(-4, 0.25)], [])]) == "n/a"


def test_trailing_mean() -> None:
    pts = [(0, 1.0), (1, 3.0), (2, 5.0), (3, 7.0)]
    # window 2: 1, (1+3)/2, (3+5)/2, (5+7)/2
    assert trailing_mean(pts, 2) == [(0, 1.0), (1, 2.0), (2, 4.0), (3, 6.0)]


# ---------------------------------------------------------------------- bad input


def test_named_experiments_resolve_at_equal_trajectories(tmp_path: Path) -> None:
    for exp in EXPERIMENTS.values():
        runs = plan(exp, tmp_path / exp.name, seeds=3)
        assert len(runs) == 3 * len(exp.arms)
        assert exp.claim and exp.cost
    runs = plan(EXPERIMENTS["smollm2"], tmp_path / "smollm2", seeds=3)
    assert runs[-1].run_dir == (tmp_path / "smollm2/runs/running_mean/seed-2").resolve()
    assert EXPERIMENTS["gae"].preset == "calc-tiny"  # multi-turn, and RL helps there


def test_unknown_experiment_and_arm_name_the_closest(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'table1'"):
        get_experiment("tabel1")
    with pytest.raises(ConfigError, match="Did you mean 'grpo'"):
        plan(EXPERIMENTS["table1"], tmp_path, seeds=1, arms=["gpro"])


def test_unknown_experiment_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiment", "critc"]) == 2
    assert "Did you mean 'critic'" in capsys.readouterr().err


def test_override_conflicting_with_an_arm_names_both(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'algo=ppo' conflicts with arm 'sao''s own 'algo=sao'"):
        plan(EXPERIMENTS["table1"], tmp_path, seeds=1, overrides=["algo=ppo"])
    with pytest.raises(ConfigError, match=r"algo.critic_steps=3.*arm 'k1'"):
        plan(EXPERIMENTS["critic"], tmp_path, seeds=1, overrides=["algo.critic_steps=3"])
    with pytest.raises(ConfigError, match="--seeds"):
        plan(EXPERIMENTS["table1"], tmp_path, seeds=1, overrides=["seed=4"])
    with pytest.raises(ConfigError, match=r"arm 'sao'.*unknown config key 'train.step'"):
        plan(EXPERIMENTS["table1"], tmp_path, seeds=1, overrides=["train.step=3"])
    # a key no arm sets applies to every arm
    runs = plan(EXPERIMENTS["table1"], tmp_path, seeds=1, overrides=["train.steps=3"])
    assert all("train.steps=3" in r.overrides for r in runs)


def test_arms_must_compare_at_equal_trajectories(tmp_path: Path) -> None:
    exp = Experiment("x", "c", "calc-tiny", {"a": ("train.steps=5",), "b": ()})
    with pytest.raises(ConfigError, match="equal trajectories per step, and equal actor steps"):
        plan(exp, tmp_path, seeds=1)
    # SAO's 10 warm-up batches on top of equal actor steps (table1), or inside equal
    # batches in all (8 + 2 = 10 batches against GRPO's 10): both compare
    base = ("train.steps=10",)
    on_top = Experiment("y", "c", "calc-tiny", {"sao": ("algo=sao",), "grpo": ("algo=grpo",)}, base)
    assert len(plan(on_top, tmp_path, seeds=1)) == 2
    inside = {
        "sao": ("algo=sao", "train.steps=8", "algo.critic_pretrain_steps=2"),
        "grpo": ("algo=grpo",),
    }
    assert len(plan(Experiment("z", "c", "calc-tiny", inside, base), tmp_path, seeds=1)) == 2
    unequal = {"sao": ("algo=sao", "train.steps=8"), "grpo": ("algo=grpo",)}  # 8 + 10 vs 10
    with pytest.raises(ConfigError, match=r"sao: 32 x 8 \(\+10\)"):
        plan(Experiment("w", "c", "calc-tiny", unequal, base), tmp_path, seeds=1)


def test_a_directory_holds_one_experiment(tmp_path: Path) -> None:
    claim_dir(EXPERIMENTS["table1"], tmp_path, [])
    claim_dir(EXPERIMENTS["table1"], tmp_path, [])  # the same again: fine (resume)
    with pytest.raises(ConfigError, match="holds experiment 'table1', not 'critic'"):
        claim_dir(EXPERIMENTS["critic"], tmp_path, [])
    with pytest.raises(ConfigError, match="another overrides"):
        claim_dir(EXPERIMENTS["table1"], tmp_path, ["train.steps=3"])
    # new wording, claims or arms are recorded; an arm made another way is refused
    t1 = EXPERIMENTS["table1"]
    reworded = replace(t1, claims=("sao > grpo",), arms={**t1.arms, "extra": ("algo=rloo",)})
    claim_dir(reworded, tmp_path, [])
    saved = json.loads((tmp_path / "experiment.json").read_text())["definition"]
    assert saved["claims"] == ["sao > grpo"] and "extra" in saved["arms"]
    with pytest.raises(ConfigError, match="another arm 'grpo'"):
        claim_dir(replace(t1, arms={**t1.arms, "grpo": ("algo=grpo_dis",)}), tmp_path, [])
    with pytest.raises(ConfigError, match="another base"):
        claim_dir(replace(t1, base=("train.steps=5",)), tmp_path, [])
    with pytest.raises(ConfigError, match="names arm 'gpro'"):
        replace(t1, claims=("sao > gpro",))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        claim_dir(EXPERIMENTS["table1"], tmp_path / "other", [])


def test_report_of_a_directory_without_an_experiment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["experiment", "--report", str(tmp_path)]) == 2
    assert "holds no experiment.json" in capsys.readouterr().err


def test_grid_file_and_its_mistakes(tmp_path: Path) -> None:
    good = tmp_path / "grid.toml"
    good.write_text(
        '[experiment]\nname = "lr"\nclaim = "lower is steadier"\nbase = ["train.steps=5"]\n'
        '[arms.high]\nset = ["train.actor_lr=3e-4"]\n[arms.low]\nset = ["train.actor_lr=1e-4"]\n'
    )
    exp = load_grid(good)
    assert exp.preset == "calc-tiny" and list(exp.arms) == ["high", "low"]
    assert exp.arms["low"] == ("train.actor_lr=1e-4",) and exp.base == ("train.steps=5",)
    assert Experiment.from_dict(json.loads(json.dumps(exp.to_dict()))) == exp
    bad = tmp_path / "bad.toml"
    bad.write_text('[experiment]\nname = "lr"\nclaim = "c"\n[arms.a]\nsett = []\n')
    with pytest.raises(ConfigError, match=r"unknown key 'sett'.*Did you mean 'set'"):
        load_grid(bad)
    bad.write_text('[experiment]\nname = "l r"\nclaim = "c"\n[arms.a]\nset = []\n')
    with pytest.raises(ConfigError, match="names a directory"):
        load_grid(bad)


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiment", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ["table1", "critic", "gae", "online"])


# ---------------------------------------------------------------------- end to end


def _grid(tmp_path: Path, policy: Path) -> Path:
    """2 arms x 2 steps on calc's prompts with the tiny 0.1M policy (no warm start
    to build), 4 trajectories a step, a checkpoint every step."""
    base = [
        f"model.path={policy}",
        "train.steps=2",
        "train.batch_size=4",
        "train.logprob_budget=0",
        "rollout.in_flight=4",
        "rollout.max_new_tokens=4",
        "rollout.max_turns=1",
        "eval.episodes=4",
        "eval.every=1",
        "log.checkpoint_every=1",
        "log.plots=false",
        "log.tensorboard=false",
    ]
    path = tmp_path / "grid.toml"
    path.write_text(
        "[experiment]\n"
        'name = "tiny"\n'
        'claim = "SAO and GRPO on the tiny grid."\n'
        f"base = {json.dumps(base)}\n"
        "[arms.sao]\n"
        'set = ["algo=sao", "algo.critic_pretrain_steps=1"]\n'
        "[arms.grpo]\n"
        'set = ["algo=grpo", "algo.group_size=2"]\n'
    )
    return path


@pytest.mark.slow
def test_tiny_grid_runs_resumes_and_rebuilds_its_report(
    tmp_path: Path, tiny_policy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grid, out = _grid(tmp_path, tiny_policy), tmp_path / "exp"
    args = ["experiment", "--file", str(grid), "--dir", str(out), "--jobs", "2"]
    # first: one seed of each arm, as if interrupted before seed 1 started
    assert main([*args, "--seeds", "1", "--keep-checkpoints"]) == 0
    runs = out / "runs"
    assert (runs / "sao" / "seed-0" / "checkpoints" / "latest").exists()
    done = runs / "sao" / "seed-0" / "summary.json"
    mtime = done.stat().st_mtime_ns
    # grpo seed 0 "interrupted" after its last checkpoint; grpo seed 1 before any
    (runs / "grpo" / "seed-0" / "summary.json").unlink()
    (runs / "grpo" / "seed-1").mkdir(parents=True)
    (runs / "grpo" / "seed-1" / "config.yaml").write_text("half-made: true\n")

    assert main([*args, "--seeds", "2"]) == 0
    printed = capsys.readouterr().out
    assert "4 runs, 1 already finished, 3 to run" in printed
    assert "grpo seed 0 (resumed): done" in printed and "sao seed 1 (started): done" in printed
    assert done.stat().st_mtime_ns == mtime  # the finished run was not run again
    for arm in ("sao", "grpo"):
        for seed in (0, 1):
            run = runs / arm / f"seed-{seed}"
            assert (run / "summary.json").is_file() and (run / "final").is_dir()
            # finished in this call without --keep-checkpoints: its checkpoints are gone
            assert (run / "checkpoints").exists() == ((arm, seed) == ("sao", 0))
    attempts = (runs / "grpo" / "seed-0" / "experiment_attempts.jsonl").read_text()
    assert [json.loads(x)["how"] for x in attempts.splitlines()] == ["fresh", "resume"]
    assert {json.loads(x)["code"] for x in attempts.splitlines()} == {code_version()}

    rows = (out / "results.csv").read_text().splitlines()
    assert rows[0].startswith("arm,seed,actor_steps,trajectories_per_step,trajectories,")
    assert [r.split(",")[:5] for r in rows[1:]] == [
        ["sao", "0", "2", "4", "12"],  # 1 critic warm-up step + 2 actor steps, 4 each
        ["sao", "1", "2", "4", "12"],
        ["grpo", "0", "2", "4", "8"],
        ["grpo", "1", "2", "4", "8"],
    ]
    md = (out / "results.md").read_text()
    assert "equal trajectories per actor step (4) and equal actor steps (2)" in md
    assert "| `sao` | 2 |" in md and "| `grpo` | 2 |" in md
    assert "| `sao` - `grpo` | 2 |" in md  # the paired differences
    assert f"Code: every run ran `{code_version()}`." in md

    def report() -> dict[str, bytes]:
        return {
            p.name: p.read_bytes() for p in out.iterdir() if p.suffix in (".csv", ".md", ".png")
        }

    before = report()
    # no explained-variance plot: every reward is 0 here, so the critic's is undefined
    assert sorted(before) == [
        "eval_success.png",
        "eval_success_seeds.png",
        "results.csv",
        "results.md",
        "reward.png",
        "staleness.png",
    ]
    for name in before:
        (out / name).unlink()
    assert main(["experiment", "--report", str(out)]) == 0
    assert report() == before

    # another machine: a copy of the report alone (no run directory) carries every run,
    # curves included, into a fresh directory; nothing runs again, the same report
    copy, fresh = tmp_path / "copy", tmp_path / "fresh"
    copy.mkdir()
    for name in ("experiment.json", "results.csv", "runs.jsonl"):
        (copy / name).write_bytes((out / name).read_bytes())
    assert main([*args[:3], "--dir", str(fresh), "--seeds", "2", "--earlier", str(copy)]) == 0
    assert "4 runs, 4 already finished (4 of them elsewhere, carried), 0 to run" in (
        capsys.readouterr().out
    )
    assert not (fresh / "runs").exists()
    again = {p.name: p.read_bytes() for p in fresh.iterdir() if p.suffix in (".csv", ".png")}
    assert again == {k: v for k, v in before.items() if not k.endswith(".md")}
    assert (fresh / "runs.jsonl").read_bytes() == (out / "runs.jsonl").read_bytes()
    md = (fresh / "results.md").read_text()
    assert "Carried from another copy of this experiment (earlier.jsonl; no run directory " in md
    assert "| `sao` - `grpo` | 2 |" in md


def test_a_warm_up_ended_by_its_plateau_rule_counts_the_batches_it_took(tmp_path: Path) -> None:
    import yaml

    from sao.config import validate
    from sao.experiments.report import read_run

    # At most 5 warm-up batches and 3 actor steps (8 batches); the rule ended the
    # warm-up at batch 2, so the actor took 6 steps, and an evaluation at batch 4 is
    # actor step 2 (not -1, as the configured 5 would place it).
    cfg = validate(
        {
            "algo": {"preset": "sao", "critic_pretrain_steps": 5, "critic_pretrain_patience": 2},
            "train": {"steps": 3},
        }
    )
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    rows: list[dict[str, float]] = [{"step": 0, "eval/success": 0.25}]
    rows += [
        {"step": 1, "critic/pretrain_plateau": 0.0},
        {"step": 2, "critic/pretrain_plateau": 1.0},
    ]
    rows += [{"step": s, "actor/loss": 0.1, "train/reward_mean": 0.5} for s in range(3, 9)]
    rows[4]["eval/success"] = 0.5  # step 4
    rows.append({"step": 8, "eval/success": 0.75, "wall_s": 10.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = read_run(tmp_path, "sao_pretrain", 0)
    assert (run.warmup_steps, run.actor_steps) == (2, 6)
    assert run.trajectories == 8 * cfg.train.batch_size  # the configured total
    assert run.curves["eval/success"] == [(-2, 0.25), (2, 0.5), (6, 0.75)]
    # without the rule's mark (it never fired), the configured most
    (tmp_path / "metrics.jsonl").write_text(
        "".join(
            json.dumps({k: v for k, v in r.items() if k != "critic/pretrain_plateau"}) + "\n"
            for r in rows
        )
    )
    fixed = read_run(tmp_path, "sao_pretrain", 0)
    assert (fixed.warmup_steps, fixed.actor_steps) == (5, 3)
