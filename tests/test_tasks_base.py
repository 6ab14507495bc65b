"""Domain registry and held-out hygiene: train and held-out draws never share a problem."""

import pytest

from posttrain.tasks import TaskError, get_domain, sample_tasks, split_of
from posttrain.tasks.arithmetic import column_trace


def test_train_and_heldout_never_overlap_even_for_fresh_seeds():
    domain = get_domain("arithmetic", operators="+-")
    heldout = {t.metadata["problem_key"] for t in sample_tasks(domain, 300, level=2, split="heldout", seed=0)}
    for seed in range(3):
        train = {t.metadata["problem_key"] for t in sample_tasks(domain, 1000, level=2, split="train", seed=seed)}
        assert not train & heldout
    fresh = {t.metadata["problem_key"] for t in sample_tasks(domain, 300, level=2, split="heldout", seed=99)}
    assert all(split_of(key) == "heldout" for key in fresh)
    assert fresh != heldout  # a fresh draw, same side of the split


def test_draws_are_deterministic_and_unique():
    domain = get_domain("arithmetic")
    a = sample_tasks(domain, 50, level=[1, 2], seed=3)
    b = sample_tasks(domain, 50, level=[1, 2], seed=3)
    assert [t.to_dict() for t in a] == [t.to_dict() for t in b]
    assert len({t.id for t in a}) == 50
    assert {t.difficulty for t in a} == {1, 2}


def test_level_too_small_for_the_request_is_an_error():
    with pytest.raises(TaskError, match="could only draw"):
        sample_tasks(get_domain("arithmetic"), 200, level=1, split="heldout")


def test_unknown_domain_suggests_the_closest():
    with pytest.raises(TaskError, match="did you mean 'arithmetic'"):
        get_domain("arithmetik")


@pytest.mark.parametrize("a,b,op", [(347, 285, "+"), (872, 343, "-"), (1000, 1, "-"), (999, 999, "+"), (5, 7, "+")])
def test_column_trace_is_correct_working(a, b, op):
    # Replaying the trace's result digits (least significant first) gives the answer.
    digits = [step.split("=")[1][-1] for step in column_trace(a, b, op).split(",")]
    last = column_trace(a, b, op).split(",")[-1].split("=")[1]
    value = int(last + "".join(reversed(digits[:-1])))
    assert value == (a + b if op == "+" else a - b)


def test_demonstration_answers_the_task():
    domain = get_domain("arithmetic")
    task = sample_tasks(domain, 1, level=3)[0]
    sample = domain.demonstration(task)
    assert sample.messages[-1] == {"role": "assistant", "content": task.verifier_args["answer"]}
    assert sample.metadata.domain == "arithmetic" and sample.metadata.difficulty == 3
    assert sample.metadata.reasoning_trace
