"""Math answers: extraction, hedges and lists, exact rationals, math-verify under an external timeout."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest

from posttrain.types import FailureClass
from posttrain.verify import VerifyError, parse_rational, stated_answers, verify_math
from posttrain.verify.math_worker import MathWorkers


@pytest.mark.parametrize("text, value", [
    ("42", Fraction(42)),
    ("-3.5", Fraction(-7, 2)),
    ("1,234,567", Fraction(1234567)),
    (r"\frac{1}{2^{99}}", Fraction(1, 2**99)),
    (r"\dfrac{-3}{4}", Fraction(-3, 4)),
    (r"\frac12", Fraction(1, 2)),
    ("2^{-3}", Fraction(1, 8)),
    ("2^3^2", Fraction(2**9)),
    (r"(1+2)\cdot 3 - 4 \div 2", Fraction(7)),
    (r"x = 5", Fraction(5)),
    (r"50\%", Fraction(50)),
    (r"12 \text{ cm}", Fraction(12)),
    (r"$\left( \frac{3}{6} \right)$", Fraction(1, 2)),
])
def test_parse_rational(text, value):
    assert parse_rational(text) == value


@pytest.mark.parametrize("text", [r"\sqrt{2}", r"\pi", "1, 2", "x + 1", "3 or 4", "2^{0.5}", "1/0", "",
                                  "2^{2^{2^{2^{2^{100}}}}}", "10^{100000}"])
def test_parse_rational_refuses_what_is_not_a_plain_rational(text):
    started = time.monotonic()
    assert parse_rational(text) is None
    assert time.monotonic() - started < 0.1  # power towers are refused, not computed


def test_answer_extraction():
    assert stated_answers(r"so \boxed{\frac{1}{2}} and \boxed{ 3 }") == [r"\frac{1}{2}", " 3 "]
    assert stated_answers(r"nested \boxed{\frac{a}{\{b\}}}") == [r"\frac{a}{\{b\}}"]
    assert stated_answers("Work...\nFinal answer: 12.") == ["12"]
    assert stated_answers("The answer is 3.5. Then we stop.") == ["3.5"]
    assert stated_answers("<think>Answer: 1</think> #### 7") == ["7"]
    assert stated_answers("no answer here") == []


@pytest.mark.parametrize("completion, reference", [
    (r"\boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{0.5}", r"\frac{1}{2}"),
    ("Answer: 1,234", "1234"),
    (r"\boxed{2^{-98}}", r"\frac{1}{2^{98}}"),
    (r"\boxed{\sqrt{2}}", r"2^{1/2}"),
    (r"\boxed{(x+1)^2}", "x^2+2x+1"),
    (r"\boxed{\{1, 2\}}", r"\{2, 1\}"),
    (r"\boxed{7}", 7),
])
def test_correct_answers_score_one(completion, reference):
    reward = verify_math(completion, reference)
    assert reward.passed and reward.score == 1.0, reward.details


@pytest.mark.parametrize("completion, reference, reason", [
    (r"\boxed{3} and \boxed{4}", "3", "multiple_answers"),
    ("Answer: 3\nAnswer: 4", "3", "multiple_answers"),
    ("The answer is 3 or 4.", "3", "hedged_answer"),
    (r"\boxed{3 \text{ or } 4}", "3", "hedged_answer"),
    (r"\boxed{maybe 3}", "3", "hedged_answer"),
    (r"\boxed{\pm 2}", "2", "hedged_answer"),
    (r"\boxed{1, 2}", "2", "answer_list"),
    (r"\boxed{2 and 3}", "2", "answer_list"),
    (r"\boxed{}", "0", "empty_answer"),
    ("I think it is 3", "3", "no_final_answer"),
    (r"\boxed{" + "1+" * 40 + "1}", "41", "answer_too_long"),
])
def test_non_answers_score_zero_with_a_reason(completion, reference, reason):
    reward = verify_math(completion, reference)
    assert reward.score == 0.0 and not reward.passed and reward.details["reason"] == reason


@pytest.mark.parametrize("completion, reference, reason", [
    (r"\boxed{2} \boxed{3} \boxed{4}", "2, 3", "answer_list"),  # more boxes than the reference has solutions
    (r"\boxed{2, 3, 4}", r"\{2, 3\}", "answer_list"),
    (r"\boxed{2 \text{ or } 3 \text{ or } 4}", "2, 3", "answer_list"),
    (r"\boxed{2} \boxed{}", "2, 3", "multiple_answers"),
    (r"\boxed{maybe 2, 3}", "2, 3", "hedged_answer"),  # "or" separates solutions; other hedges stay hedges
    (r"\boxed{\pm 1 \pm 2}", "1, 3", "hedged_answer"),  # several signs in one item are not expanded
    (r"\boxed{(1,2), (2,1)}", "(1,2)", "answer_list"),  # one ordered pair: both orders is a list
    (r"\boxed{4 \text{ and more}}", "4", "hedged_answer"),
])
def test_solution_sets_keep_the_anti_hacking_rules(completion, reference, reason):
    reward = verify_math(completion, reference)
    assert reward.score == 0.0 and reward.details["reason"] == reason, reward.details


@pytest.mark.parametrize("completion, reference", [
    (r"\boxed{(7,11),(11,7)}", r"(11,7) \text{ or } (7,11)"),
    (r"\boxed{-10,-8,4}", "a=4,-8,-10"),
    (r"So $a=\boxed{4}$, $a=\boxed{-8}$ or $a=\boxed{-10}$.", "a=4,-8,-10"),
    (r"\boxed{11,\!111}", "11111"),
    (r"\boxed{28 \text{ percent}}", r"28\%"),
    (r"\boxed{\pm 3}", "3, -3"),
])
def test_the_issue_examples_score_one(completion, reference):
    reward = verify_math(completion, reference)
    assert reward.passed, reward.details


def test_an_ordered_pair_keeps_its_order_inside_a_set():
    assert not verify_math(r"\boxed{(2,1),(4,3)}", "(1,2),(3,4)").passed
    assert verify_math(r"\boxed{(3,4),(1,2)}", "(1,2),(3,4)").details["method"] == "solution_set"


def test_several_equal_boxes_are_one_answer():
    assert verify_math(r"\boxed{0.5} ... so again \boxed{\frac{1}{2}}", "1/2").passed


def test_near_miss_tiny_magnitudes_are_wrong():
    reward = verify_math(r"\boxed{\frac{1}{2^{99}}}", r"\frac{1}{2^{98}}")
    assert reward.score == 0 and reward.details["method"] == "exact_rational"
    # math-verify alone (6-digit rounding) would have accepted it; the exact check also guards its path
    reward = verify_math(r"\boxed{\frac{1}{2^{99}} + 0 \cdot \sqrt{2}}", r"\frac{1}{2^{98}}")
    assert reward.score == 0


def test_adversarial_answer_returns_within_the_timeout():
    started = time.monotonic()
    reward = verify_math(r"\boxed{\sqrt{2}^{\sqrt{2}^{\sqrt{2}^{\sqrt{2}^{\sqrt{2}^{10^{10}}}}}}}", r"\sqrt{3}",
                         timeout_s=1.0)
    assert reward.score == 0 and not reward.is_infrastructure_failure
    assert time.monotonic() - started < 1.0 + 3.0  # the timeout plus starting a fresh worker at most


def test_a_hung_comparison_is_killed_and_the_worker_replaced():
    workers = MathWorkers(size=1)
    try:
        assert workers.check("1", "1", None, timeout_s=30) == "equal"  # started (sympy import) outside timing
        started = time.monotonic()
        verdict = workers.check(r"\sqrt{3}", r"2^{2^{2^{2^{2^{2^{2^{2^{1000}}}}}}}}", None, timeout_s=0.5)
        assert verdict in ("timeout", "different") and time.monotonic() - started < 2.0
        assert workers.check(r"\frac{2}{4}", r"\frac{1}{2}", None, timeout_s=30) == "equal"
    finally:
        workers.close()


def test_malformed_reference_is_a_verify_error_and_bad_completions_score_zero():
    with pytest.raises(VerifyError, match="reference"):
        verify_math(r"\boxed{1}", "")
    for garbage in (b"\xff\xfe\x00\x01" * 10, "\x00\x01\x02" * 50, "x" * 300_000, None, 42):
        reward = verify_math(garbage, "1")
        assert reward.score == 0 and reward.failure == FailureClass.FORMAT
