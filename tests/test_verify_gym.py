"""reasoning-gym entries scored exactly: no partial credit for answers that merely contain the right one, and
the datasets' own scorers (some of which eval the answer) run in the sandbox, never in the trainer."""

from __future__ import annotations

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from posttrain.types import FailureClass  # noqa: E402
from posttrain.verify import VerifyError, verify_reasoning_gym  # noqa: E402

pytestmark = pytest.mark.bwrap


def entry(name: str, seed: int = 3) -> dict:
    return dict(reasoning_gym.create_dataset(name, size=1, seed=seed)[0])


def test_exact_answer_scores_one_without_the_scorer():
    item = entry("simple_equations")
    reward = verify_reasoning_gym(f"<think>...</think><answer>{item['answer']}</answer>", item)
    assert reward.passed and reward.details["method"] == "exact"


def test_containing_the_answer_earns_no_partial_credit():
    item = entry("simple_equations")
    padded = f"<answer>the value is {item['answer']}</answer>"
    assert reasoning_gym.get_score_answer_fn("simple_equations")(f"the value is {item['answer']}", item) > 0
    reward = verify_reasoning_gym(padded, item)
    assert reward.score == 0 and 0 < reward.details["raw_score"] < 1 and reward.details["method"] == "scorer"


def test_a_dataset_with_several_right_answers_uses_its_scorer_in_the_sandbox():
    item = entry("countdown", seed=1)
    rewritten = f"({item['answer']})"  # not the stored string, the same expression: only the scorer knows
    right = verify_reasoning_gym(f"<answer>{rewritten}</answer>", item)
    assert right.passed and right.details == {**right.details, "method": "scorer", "raw_score": 1.0}
    wrong = verify_reasoning_gym(f"<answer>{item['answer']} + 1</answer>", item)
    assert wrong.score == 0 and wrong.details["raw_score"] < 1 and not wrong.is_infrastructure_failure


def test_code_in_an_answer_never_reaches_a_scorer_and_bad_entries_are_errors():
    item = entry("spiral_matrix")
    reward = verify_reasoning_gym("<answer>__import__('os').system('id')</answer>", item)
    assert reward.score == 0 and reward.details["reason"] == "unsafe_answer"
    assert verify_reasoning_gym("<answer>1</answer><answer>2</answer>", item).details["reason"] == "multiple_answers"
    assert verify_reasoning_gym("", item).failure == FailureClass.FORMAT
    with pytest.raises(VerifyError, match="dataset entry"):
        verify_reasoning_gym("<answer>1</answer>", {"question": "q"})
    with pytest.raises(VerifyError, match="no dataset name"):
        verify_reasoning_gym("<answer>1</answer>", {"answer": "1", "metadata": {}})
