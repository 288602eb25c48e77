"""The run summary's first and last readings of the held-out critic (by turn)
and of what the environments reported, and the by-turn calibration plot."""

from __future__ import annotations

from pathlib import Path

from sao.rundir.metrics import summarize, write_plots


def _history() -> list[dict[str, float]]:
    return [
        {
            "step": 0.0,
            "eval/success": 0.25,
            "eval/critic_auc_turn1": 0.5,
            "eval/critic_auc_turn2": 0.55,
            "eval/guess/in_interval": 0.4,
            "eval/env_error": 0.0,
        },
        {"step": 5.0, "train/reward_mean": 0.3},
        {
            "step": 10.0,
            "eval/success": 0.5,
            "eval/critic_auc_turn1": 0.6,
            "eval/critic_auc_turn2": 0.8,
            "eval/guess/in_interval": 0.7,
            "eval/env_error": 0.0,
        },
    ]


def test_the_summary_holds_first_and_last_of_each_held_out_reading() -> None:
    s = summarize(_history())
    assert s["eval/success_first"] == 0.25 and s["eval/success_last"] == 0.5
    assert (s["eval/critic_auc_turn2_first"], s["eval/critic_auc_turn2_last"]) == (0.55, 0.8)
    assert (s["eval/guess/in_interval_first"], s["eval/guess/in_interval_last"]) == (0.4, 0.7)
    assert "eval/env_error_first" not in s  # the evaluation's own counters stay out


def test_the_calibration_by_turn_is_plotted_when_an_evaluation_has_two_turns(
    tmp_path: Path,
) -> None:
    written = write_plots(_history(), tmp_path)
    assert tmp_path / "critic_by_turn.png" in written
    assert (tmp_path / "critic_by_turn.png").stat().st_size > 1000
    single = [{"step": 0.0, "eval/success": 0.1, "eval/critic_auc_turn1": 0.5}]
    (tmp_path / "one").mkdir()
    assert tmp_path / "one" / "critic_by_turn.png" not in write_plots(single, tmp_path / "one")
