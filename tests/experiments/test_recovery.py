"""Steps to recover after a preference switch, worked by hand."""

from __future__ import annotations

from sao.experiments.recovery import recovery_steps

EVALS = [(0, 0.1), (10, 0.5), (20, 0.9), (30, 0.1), (40, 0.6), (50, 0.75), (60, 0.95)]


def test_recovery_is_counted_from_the_switch_to_the_first_eval_back_at_80_percent() -> None:
    # before the switch at 25: 0.9 (step 20); 80% of it is 0.72; 0.1, 0.6 fall short,
    # 0.75 at step 50 reaches it: 50 - 25 = 25 steps
    assert recovery_steps(EVALS, 25) == 25
    # a switch exactly on an eval step: that eval (0.9 at 20) is still the old preference's;
    # the first at or above 0.72 after it is 0.75 at step 50: 30 steps
    assert recovery_steps(EVALS, 20) == 30


def test_recovery_limits() -> None:
    assert recovery_steps(EVALS, 25, until=45) is None  # not back before the next switch
    assert recovery_steps(EVALS, 25, share=1.0) == 60 - 25  # 0.95 >= 0.9
    assert recovery_steps([(0, 0.0), (10, 0.5)], 5) is None  # nothing learned before it
    assert recovery_steps([(10, 0.5)], 5) is None  # no eval before the switch


def test_recovery_is_measured_against_the_best_level_before_the_switch() -> None:
    # learned 0.9 at step 10, failed the next preference (0 at 20, 30), switch at 35:
    # the target is 80% of 0.9 = 0.72, reached by 0.8 at step 50: 15 steps
    evals = [(0, 0.4), (10, 0.9), (20, 0.0), (30, 0.0), (40, 0.5), (50, 0.8)]
    assert recovery_steps(evals, 35) == 15
