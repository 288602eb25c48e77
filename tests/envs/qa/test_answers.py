"""Honest rewards: an answer comes from a marker, and a numeric reference
needs a number, so that echoing the question's computation scores 0.

The attack these guard against: asked ``What is 16 - 45?`` (reference ``-29``),
a policy replies ``16 - 45``; math-verify evaluates it to -29, a match."""

from __future__ import annotations

import pytest

pytest.importorskip("math_verify")

from sao.envs.qa.answers import exact_score, extract_answer, is_value, math_score


@pytest.mark.parametrize("reply", ["16 - 45", "16-45", "16 - 45\n"])
def test_bare_echo_has_no_answer_and_scores_zero(reply: str) -> None:
    assert extract_answer(reply) is None
    assert math_score(reply, "-29") == 0.0
    # the whole-reply fallback alone still refuses an expression for a number ...
    assert math_score(reply, "-29", require_marker=False) == 0.0
    # ... and with both checks off the echo is the hack it was
    assert math_score(reply, "-29", require_marker=False, require_value=False) == 1.0


@pytest.mark.parametrize(
    "reply",
    ["answer 16 - 45", "answer: \\boxed{16 - 45}", "so \\boxed{16-45}", "<answer>16 - 45</answer>"],
)
def test_echo_inside_a_marker_scores_zero(reply: str) -> None:
    assert extract_answer(reply) in ("16 - 45", "16-45")
    assert math_score(reply, "-29") == 0.0
    assert math_score(reply, "-29", require_value=False) == 1.0  # the opt-out accepts it


def test_a_computation_for_a_fraction_scores_zero() -> None:
    # 3/4 + 1/8 = 6/8 + 1/8 = 7/8: the right value, not written as one
    assert math_score("answer 3/4 + 1/8", "7/8") == 0.0
    assert math_score("answer \\frac{3}{4}+\\frac{1}{8}", "7/8") == 0.0
    assert math_score("answer 7/8", "7/8") == 1.0


@pytest.mark.parametrize(
    ("reply", "reference"),
    [
        ("answer -29", "-29"),
        ("answer -29.0", "-29"),
        ("answer: $-29$.", "-29"),
        ("answer **-29**", "-29"),
        ("work\n\\boxed{1/2}", "0.5"),
        ("answer \\frac{1}{2}", "0.5"),
        ("answer \\boxed{\\dfrac{1}{2}}", "0.5"),  # \dfrac: math-verify reads it as $...$
        ("answer 0.5", "\\frac{1}{2}"),
        ("answer 0.875", "7/8"),  # 7/8 = 0.875
        ("answer 7/8", "0.875"),
        ("answer 1,000", "1000"),
        ("answer x = 5", "5"),
        ("<answer>50\\%</answer>", "50"),
    ],
)
def test_equivalent_forms_of_a_value_match(reply: str, reference: str) -> None:
    assert math_score(reply, reference) == 1.0


def test_wrong_values_in_every_marker_score_zero() -> None:
    assert math_score("answer -28", "-29") == 0.0
    assert math_score("\\boxed{1/3}", "0.5") == 0.0
    assert math_score("<answer>0.25</answer>", "0.5") == 0.0


def test_a_reference_that_is_an_expression_is_compared_by_value() -> None:
    # no value check when the reference is itself a computation or not a number:
    # 16 - 45 = -29 either way round, and sqrt(2)/2 = \frac{\sqrt{2}}{2}
    assert math_score("answer 16 - 45", "16 - 45") == 1.0
    assert math_score("answer -29", "16 - 45") == 1.0
    assert math_score("answer \\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}") == 1.0
    assert math_score("answer 2x + 2", "2(x + 1)") == 1.0
    assert math_score("answer \\sqrt{8}", "2\\sqrt{2}") == 1.0
    assert math_score("answer 2", "2\\sqrt{2}") == 0.0  # read bare, 2\sqrt{2} is 2
    assert math_score("answer 2", "2^{10}") == 0.0
    assert math_score("answer 16 - 44", "16 - 45") == 0.0
    assert math_score("16 - 45", "16 - 45") == 0.0  # still needs a marker


def test_marker_order_and_missing_answers() -> None:
    assert extract_answer("work...\nanswer: 7\n") == "7"
    assert extract_answer("\\boxed{3} then\nanswer 4") == "4"  # the answer line wins
    assert extract_answer("answer is \\boxed{5}") == "5"  # its box, when it has one
    assert extract_answer("\\boxed{1} or \\boxed{2}") == "2"  # the last box
    assert extract_answer("x <answer>3</answer> <answer>9</answer>") == "9"
    assert extract_answer("answer = 12") is None  # "answer = " is not an answer line
    assert extract_answer("answer\n") is None and extract_answer("\\boxed{}") is None
    assert extract_answer(" it is 7 ", require_marker=False) == "it is 7"


def test_exact_score_needs_a_marker_unless_told_otherwise() -> None:
    assert exact_score("answer Paris.", "paris") == 1.0
    assert exact_score("Paris", "paris") == 0.0
    assert exact_score("Paris", "paris", require_marker=False) == 1.0


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("-29", True),
        ("+3.25", True),
        (".5", True),
        ("1,000", True),
        ("\\frac{1}{2}", True),
        ("-\\tfrac{3}{4}", True),
        ("\\frac12", True),
        ("$0.5$", True),
        ("5 \\text{ cm}", True),
        ("16 - 45", False),
        ("-29 + 0", False),
        ("2*3", False),
        ("\\sqrt{4}", False),
        ("1,2", False),
        ("x + 1", False),
        ("", False),
    ],
)
def test_is_value(text: str, value: bool) -> None:
    assert is_value(text) is value
