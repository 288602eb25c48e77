"""The report's switch parts: recovery steps per arm and switch and the
training reward per phase (worked by hand), the results.csv column, and the
per-style plot."""

from __future__ import annotations

from pathlib import Path

from sao.experiments.grid import Experiment
from sao.experiments.report import RunResult, results_csv
from sao.experiments.switches import (
    phase_rewards,
    recoveries,
    recovery_md,
    write_style_plot,
)

EXP = Experiment(
    name="switch",
    claim="follows the preference",
    preset="style-shift-tiny",
    arms={"fast": (), "slow": ()},
    marks=(20, 40),
)


def run(arm: str, seed: int, evals: list[tuple[int, float]]) -> RunResult:
    style = [(s, v / 2) for s, v in evals]
    return RunResult(
        arm=arm, seed=seed, actor_steps=60, batch_size=4, warmup_steps=0,
        initial_success=evals[0][1], final_success=evals[-1][1], best_success=1.0,
        final_reward=0.5, collapse_step=None, wall_s=1.0,
        curves={"eval/success": evals, "eval/style_cute": style, "eval/style_classical": style},
    )  # fmt: skip


# the best before each switch is 0.9 (step 20): target 0.72 after 20 and after 40
FAST0 = run("fast", 0, [(0, 0.2), (10, 0.5), (20, 0.9), (30, 0.8), (40, 0.8), (50, 0.75)])
FAST1 = run("fast", 1, [(0, 0.2), (10, 0.5), (20, 0.9), (30, 0.1), (40, 0.8), (50, 0.1)])
SLOW = run("slow", 0, [(0, 0.2), (10, 0.5), (20, 0.9), (30, 0.1), (40, 0.1), (50, 0.1)])


def test_recoveries_per_switch_stop_at_the_next_one() -> None:
    assert recoveries(FAST0, EXP.marks) == [10, 10]  # 0.8 at 30 >= 0.72; 0.75 at 50 too
    assert recoveries(FAST1, EXP.marks) == [20, None]  # 0.8 at 40 (<= the next switch)
    # never back after 20, nor after 40: its 0.1 there is measured against the
    # 0.9 it had learned before (target 0.72), not against the 0.1 it fell to
    assert recoveries(SLOW, EXP.marks) == [None, None]


def test_recovery_table_and_csv_column() -> None:
    md = "\n".join(recovery_md(EXP, [FAST0, FAST1, SLOW]))
    # fast after 20: 10 and 20 steps -> mean 15, std 7.07, t(0.975, 1) = 12.7062:
    # 15 +- 12.7062 * 7.0711 / sqrt(2) = 15 +- 63.5 -> [-48.5, 78.5]
    assert "| `fast` | 2/2: 15.0 ± 7.1 [-48.5, 78.5] | 1/2: 10.0 (one seed) |" in md
    assert "| `slow` | 0/1 | 0/1 |" in md
    rows = results_csv([FAST0, FAST1], EXP.marks).splitlines()
    assert rows[0].endswith(",recovery_steps")
    assert rows[1].endswith(",10;10") and rows[2].endswith(",20;")


def test_training_reward_per_phase() -> None:
    # phases: steps 0..20, 21..40, after 40 (a warm-up step -1 counts in none)
    rewards = [(-1, 9.0), (0, 0.2), (20, 0.8), (21, 0.0), (40, 0.3), (41, 0.6), (60, 0.4)]
    a = RunResult(**{**FAST0.__dict__, "curves": {"train/reward": rewards}})
    # (0.2 + 0.8) / 2 = 0.5; (0.0 + 0.3) / 2 = 0.15; (0.6 + 0.4) / 2 = 0.5
    assert phase_rewards(a, EXP.marks) == [0.5, 0.15, 0.5]
    b = RunResult(**{**a.__dict__, "seed": 1, "curves": {"train/reward": [(5, 0.7), (45, 0.1)]}})
    assert phase_rewards(b, EXP.marks) == [0.7, None, 0.1]
    md = "\n".join(recovery_md(EXP, [a, b]))
    # steps 0-20: 0.5 and 0.7 -> mean 0.6, std 0.141421; 12.7062 * 0.141421 / sqrt(2)
    # = 1.27062 -> [-0.671, 1.871]; 21-40: 0.15 alone; after 40: 0.5 and 0.1 -> 0.3 ± 0.283,
    # half-width 12.7062 * 0.282843 / sqrt(2) = 2.54124 -> [-2.241, 2.841]
    assert "| arm | steps 0-20 | steps 21-40 | steps after 40 |" in md
    assert (
        "| `fast` | 0.600 ± 0.141 [-0.671, 1.871] | 0.150 (one seed) "
        "| 0.300 ± 0.283 [-2.241, 2.841] |" in md
    )


def test_style_plot_has_a_panel_per_reported_style(tmp_path: Path) -> None:
    path = write_style_plot([FAST0, SLOW], EXP, tmp_path, ["cute", "classical", "cute"])
    assert path == tmp_path / "eval_per_style.png" and path.stat().st_size > 1000
    plain = RunResult(
        **{**FAST0.__dict__, "curves": {"eval/success": FAST0.curves["eval/success"]}}
    )
    assert write_style_plot([plain], EXP, tmp_path) is None
