"""The `fractions` domain: sums of two proper fractions judged by the `math` verifier, exactly."""

from __future__ import annotations

from fractions import Fraction

import pytest

from posttrain.tasks import TaskError, get_domain, sample_tasks
from posttrain.tasks.fractions import lcd_trace
from posttrain.verify import verify


def test_demonstrations_pass_the_math_verifier_and_wrong_or_hedged_answers_do_not():
    domain = get_domain("fractions")
    tasks = sample_tasks(domain, 60, level=1, seed=3)
    for task in tasks:
        a, b, c, d = task.metadata["terms"]
        value = Fraction(a, b) + Fraction(c, d)
        assert task.verifier == "math" and Fraction(task.metadata["answer"]) == value
        assert verify(task, domain.demonstration(task).messages[-1]["content"], {}).score == 1.0
        unreduced = f"{value.numerator * 3}/{value.denominator * 3}"
        assert verify(task, f"Answer: {unreduced}", {}).score == 1.0  # an equal rational is right
        off = value + Fraction(1, 97)
        assert verify(task, f"Answer: {off.numerator}/{off.denominator}", {}).score == 0.0
        assert verify(task, f"Answer: {task.metadata['answer']} or 1/2", {}).score == 0.0  # a hedge


def test_the_trace_brings_both_terms_to_the_least_common_denominator_and_reduces():
    assert lcd_trace(3, 4, 1, 6) == "lcd 12: 9/12+2/12=11/12"
    assert lcd_trace(1, 2, 1, 6) == "lcd 6: 3/6+1/6=4/6=2/3"
    assert lcd_trace(1, 2, 1, 2) == "lcd 2: 1/2+1/2=2/2=1"


def test_train_and_heldout_never_share_a_problem_and_one_level_only():
    domain = get_domain("fractions")
    train = {t.metadata["problem_key"] for t in sample_tasks(domain, 800, level=1, split="train", seed=0)}
    heldout = {t.metadata["problem_key"] for t in sample_tasks(domain, 150, level=1, split="heldout", seed=0)}
    assert len(train) == 800 and len(heldout) == 150 and not train & heldout
    with pytest.raises(TaskError, match="level 2 outside 1..1"):
        sample_tasks(domain, 1, level=2)
