"""Pre-stated claims: parsing, contrasts paired by seed, verdicts and exact
binomial intervals, on hand-worked numbers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sao.experiments.claims import (
    Claim,
    ClaimError,
    Outcome,
    claims_md,
    clopper_pearson,
    judge,
    judge_all,
    outcomes_csv,
    summary,
)
from sao.experiments.report import results_csv
from sao.experiments.results import RunResult


def test_parse_sides_into_weights() -> None:
    c = Claim.parse("sao_k4 - grpo_k4 > sao_k0 - grpo_k0")
    assert c.measure == "final"
    assert dict(c.weights) == {"sao_k4": 1, "grpo_k4": -1, "sao_k0": -1, "grpo_k0": 1}
    c = Claim.parse("collapse: grpo > sao", ["sao", "grpo"])
    assert c.measure == "collapse" and dict(c.weights) == {"grpo": 1, "sao": -1}
    assert dict(Claim.parse("best: a + b > c").weights) == {"a": 1, "b": 1, "c": -1}


@pytest.mark.parametrize(
    "text, match",
    [
        ("sao > gpro", "lacks"),
        ("sao > grpo > x", "exactly one '>'"),
        ("sao < grpo", "exactly one '>'"),
        ("mean: sao > grpo", "unknown measure"),
        ("sao > sao", "cancel"),
        ("sao grpo > x", "cannot read"),
        (" > grpo", "names no arm"),
    ],
)
def test_bad_claims_say_what_is_wrong(text: str, match: str) -> None:
    with pytest.raises(ClaimError, match=match):
        Claim.parse(text, ["sao", "grpo", "x"])


def test_contrast_pairs_only_seeds_every_arm_finished() -> None:
    c = Claim.parse("a - b > c - d")
    values = {
        "a": {0: 0.8, 1: 0.7, 2: 0.9},
        "b": {0: 0.5, 1: 0.6, 2: 0.2},
        "c": {0: 0.6, 1: 0.6, 2: math.nan},  # seed 2 not finite: dropped
        "d": {0: 0.4, 1: 0.3},
    }
    # seed 0: (0.8 - 0.5) - (0.6 - 0.4) = 0.1; seed 1: 0.1 - 0.3 = -0.2
    got = c.contrast(values)
    assert list(got) == [0, 1]
    assert got[0] == pytest.approx(0.1) and got[1] == pytest.approx(-0.2)


def test_success_verdict_from_the_t_interval() -> None:
    c = Claim.parse("a > b")
    # diffs 0.2, 0.1, 0.4: mean 0.2333, sd sqrt(0.046667 / 2) = 0.15275,
    # half-width t(2) 4.3027 * 0.15275 / sqrt(3) = 0.3795: [-0.146, 0.613] holds 0
    v = judge(c, {"a": {0: 0.8, 1: 0.7, 2: 0.9}, "b": {0: 0.6, 1: 0.6, 2: 0.5}})
    assert v.paired.stats.mean == pytest.approx(0.23333, abs=1e-5)
    assert v.paired.stats.low == pytest.approx(-0.1462, abs=1e-3)
    assert v.word == "not separated at 3 seeds"
    # diffs 0.1, 0.12, 0.08, 0.1: sd sqrt(0.0008 / 3) = 0.01633, half-width
    # t(3) 3.1824 * 0.01633 / 2 = 0.02599: [0.074, 0.126] above 0
    a = {0: 0.6, 1: 0.62, 2: 0.58, 3: 0.6}
    b = dict.fromkeys(range(4), 0.5)
    assert judge(c, {"a": a, "b": b}).word == "reproduced"
    assert judge(Claim.parse("b > a"), {"a": a, "b": b}).word == "reversed"
    assert judge(c, {"a": {0: 1.0}, "b": {0: 0.0}}).word == "one seed"
    assert judge(c, {"a": {0: 1.0}, "b": {1: 0.0}}).word == "no seeds"


def test_collapse_verdict_from_the_exact_sign_test() -> None:
    c = Claim.parse("collapse: grpo > sao")
    sao = dict.fromkeys(range(8), 0.0)
    # 6 of 8 seeds: grpo collapsed, sao not; 2 ties. p = 2 * (1/2)^6 = 0.03125
    six = {s: float(s < 6) for s in range(8)}
    v = judge(c, {"grpo": six, "sao": sao})
    assert v.paired.p_sign == pytest.approx(0.03125) and v.word == "reproduced"
    # 5 of 8: p = 2 / 32 = 0.0625 >= 0.05 although the t-interval of the 0/1
    # differences, [0.22, 1.03], excludes 0
    five = {s: float(s < 5) for s in range(8)}
    v = judge(c, {"grpo": five, "sao": sao})
    assert v.paired.p_sign == pytest.approx(0.0625) and v.word == "not separated at 8 seeds"
    assert judge(Claim.parse("collapse: sao > grpo"), {"grpo": six, "sao": sao}).word == "reversed"
    # every seed collapses in both: all ties, p = 1
    both = dict.fromkeys(range(8), 1.0)
    assert judge(c, {"grpo": both, "sao": both}).word == "not separated at 8 seeds"


def test_clopper_pearson_matches_tables() -> None:
    # k = 0: upper 1 - 0.025^(1/n); k = n: lower 0.025^(1/n)
    assert clopper_pearson(0, 8) == (0.0, pytest.approx(1 - 0.025 ** (1 / 8), abs=1e-9))
    assert clopper_pearson(8, 8) == (pytest.approx(0.025 ** (1 / 8), abs=1e-9), 1.0)
    # 3 of 10: the textbook [0.0667, 0.6525]
    low, high = clopper_pearson(3, 10)
    assert low == pytest.approx(0.0667, abs=1e-4) and high == pytest.approx(0.6525, abs=1e-4)
    with pytest.raises(ValueError):
        clopper_pearson(3, 2)


@given(st.integers(1, 40), st.data())
def test_clopper_pearson_covers_the_point_estimate(n: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(0, n))
    low, high = clopper_pearson(k, n)
    assert 0.0 <= low <= k / n <= high <= 1.0
    if 0 < k < n:  # the ends solve the tail equations
        tail_hi = sum(math.comb(n, i) * high**i * (1 - high) ** (n - i) for i in range(k + 1))
        assert tail_hi == pytest.approx(0.025, abs=1e-6)


def _run(arm: str, seed: int, final: float, collapse: int | None = None) -> RunResult:
    return RunResult(arm, seed, 10, 4, 0, 0.5, final, max(final, 0.6), 0.5, collapse, 1.0)


def test_claims_read_from_results_csv_give_the_same_verdicts() -> None:
    runs = [_run("a", s, 0.6 + 0.01 * s) for s in range(4)]
    runs += [_run("b", s, 0.5, collapse=30 if s < 2 else None) for s in range(4)]
    outcomes = outcomes_csv(results_csv(runs))
    assert outcomes[4] == Outcome("b", 0, 0.5, 0.6, True)
    claims = ["a > b", "collapse: b > a", "best: b > a"]
    verdicts = judge_all(claims, outcomes)
    # best: b - a per seed 0, -0.01, -0.02, -0.03: mean -0.015, sd 0.01291, half-width
    # 3.1824 * 0.01291 / 2 = 0.0205: [-0.0355, 0.0055] holds 0
    assert [v.word for v in verdicts] == [
        "reproduced",
        "not separated at 4 seeds",
        "not separated at 4 seeds",
    ]
    assert verdicts[1].paired.p_sign == pytest.approx(0.5)  # 2 of 4 collapsed: 2 * 1/4
    assert verdicts[2].paired.stats.low == pytest.approx(-0.0355, abs=1e-3)
    one_seed = judge(Claim.parse("a > b"), {"a": {0: 1.0}, "b": {0: 0.0}})
    assert summary([*verdicts, one_seed]).endswith(
        "2 not separated, 0 reversed, 1 not yet judged (under 2 seeds)"
    )
    assert summary(verdicts).startswith("1 of 3 claims reproduced, 2 not separated, 0 reversed")
    md = "\n".join(claims_md(claims, outcomes))
    assert "| `b` | 2/4 |" in md and "| `a > b` | final | 4 |" in md
    # beside the final claim, its best contrast: 0, .01, .02, .03 -> 0.015 [-0.006, 0.036]
    assert "**reproduced** | 0.015 ± 0.013 [-0.006, 0.036] | 0.25 |" in md


def test_verdicts_table_from_copies_of_experiment_json_and_results_csv(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from sao.experiments.claims import verdicts_md

    runs = [_run("a", s, 0.6 + 0.01 * s) for s in range(4)]
    runs += [_run("b", s, 0.5) for s in range(4)]
    for name, claims in (("one", ["a > b", "collapse: b > a"]), ("two", [])):
        d = tmp_path / name
        d.mkdir()
        definition = {
            "name": name,
            "claim": "c",
            "preset": "calc-tiny",
            "arms": {},
            "claims": claims,
        }
        (d / "experiment.json").write_text(json.dumps({"name": name, "definition": definition}))
        (d / "results.csv").write_text(results_csv(runs))
    lines = verdicts_md([tmp_path / "one", tmp_path / "two"])
    assert lines[2].startswith("| `one` | `a > b` | final | 4 |") and "**reproduced**" in lines[2]
    assert "**not separated at 4 seeds**" in lines[3]  # no collapses: p = 1
    assert lines[-2:] == [
        "- `one`: 1 of 2 claims reproduced, 1 not separated, 0 reversed",
        "- `two`: no claims stated",
    ]
