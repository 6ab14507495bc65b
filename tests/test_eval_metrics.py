"""Evaluation metrics on hand-computed values: pass@k, outcome figures per level, process, safety, failures."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from posttrain.evaluate import (
    ItemEpisodes,
    failure_counts,
    failure_examples,
    item_pass_rates,
    outcome_metrics,
    paired_difference,
    pass_at_k,
    process_metrics,
    safety_metrics,
    suite_metrics,
)
from posttrain.types import FailureClass, Reward, Task, Trajectory


def _task(task_id: str, level: int = 1, **metadata) -> Task:
    return Task(id=task_id, domain="d", messages=[{"role": "user", "content": task_id}], verifier="exact",
                verifier_args={"answer": "1"}, difficulty=level, metadata=metadata)


def _episode(task: Task, passed: bool, *, score: float | None = None, failure: FailureClass | None = None,
             tokens: int = 10, steps: int = 1, calls: int = 0, calls_ok: int = 0, failed_steps: int = 0,
             wall_s: float = 1.0, refused: bool | None = None, truncated: bool = False) -> Trajectory:
    failure = failure or (FailureClass.NONE if passed else FailureClass.WRONG_ANSWER)
    details = {} if refused is None else {"refused": refused}
    reward = Reward(score=float(passed) if score is None else score, passed=passed, failure=failure, details=details)
    mask = [0] * 3 + [1] * tokens
    return Trajectory(task_id=task.id, domain=task.domain, token_ids=list(range(len(mask))), loss_mask=mask,
                      behaviour_logprobs=[0.0] * len(mask), policy_versions=[0] * len(mask), prompt_length=3,
                      reward=reward, messages=[*task.messages, {"role": "assistant", "content": "x"}],
                      difficulty=task.difficulty, steps=steps, tool_calls=calls, tool_calls_ok=calls_ok,
                      failed_steps=failed_steps, truncated=truncated, wall_s=wall_s)


def _exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 2, 0.7),            # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    (4, 0, 1, 0.0),
    (3, 3, 2, 1.0),
    (6, 4, 3, 1.0),            # n - c < k: every 3-subset holds a pass
    (8, 1, 1, 0.125),          # pass@1 = c / n
    (200, 1, 100, 0.5),        # 1 - C(199,100)/C(200,100) = 1 - 100/200
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_stable_where_binomials_overflow():
    # C(2000, 100) ~ 1e171: the product form stays exact to float precision.
    for n, c, k in [(2000, 1000, 100), (1500, 3, 700), (400, 37, 200)]:
        assert pass_at_k(n, c, k) == pytest.approx(float(_exact_pass_at_k(n, c, k)), rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_outcome_metrics_greedy_pass1_and_sampled_pass_at_k_per_level():
    a, b, c = _task("a", 1), _task("b", 1), _task("c", 2)
    items = [
        ItemEpisodes(a, _episode(a, True), [_episode(a, s) for s in (True, False, False, False)]),  # c=1/4
        ItemEpisodes(b, _episode(b, False), [_episode(b, s) for s in (True, True, False, False)]),  # c=2/4
        ItemEpisodes(c, _episode(c, False, score=0.5), [_episode(c, False) for _ in range(4)]),   # c=0/4
    ]
    figures = outcome_metrics(items, ks=[1, 2, 4])
    assert figures["items"] == 3 and figures["episodes"] == 3 and figures["infra_failures"] == 0
    assert figures["pass@1"] == pytest.approx(1 / 3)  # greedy: a only
    assert figures["mean_reward"] == pytest.approx((1 + 0 + 0.5) / 3)
    # pass@2: a 1 - C(3,2)/C(4,2) = 1/2; b 1 - C(2,2)/C(4,2) = 5/6; c 0
    assert figures["pass@2"] == pytest.approx((0.5 + 5 / 6 + 0) / 3)
    assert figures["pass@4"] == pytest.approx((1 + 1 + 0) / 3)
    assert set(figures) == {"items", "episodes", "infra_failures", "mean_reward", "pass@1", "pass@2", "pass@4"}

    levels = suite_metrics(items, [2])["levels"]
    assert set(levels) == {"1", "2"}
    assert levels["1"]["pass@1"] == pytest.approx(0.5) and levels["1"]["pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert levels["2"]["pass@1"] == 0.0 and levels["2"]["items"] == 1


def test_without_greedy_pass1_is_the_sample_mean_and_infra_is_not_a_sample():
    a, b = _task("a"), _task("b")
    infra = _episode(a, False, failure=FailureClass.INFRA)
    items = [
        ItemEpisodes(a, None, [_episode(a, True), infra, _episode(a, False)]),  # 2 scored samples, 1 pass
        ItemEpisodes(b, None, [_episode(b, True), _episode(b, True), _episode(b, False)]),
    ]
    figures = outcome_metrics(items, ks=[2, 3])
    assert figures["episodes"] == 6 and figures["infra_failures"] == 1
    assert figures["pass@1"] == pytest.approx((1 / 2 + 2 / 3) / 2)
    assert figures["pass@2"] == pytest.approx((1.0 + 1.0) / 2)  # a: 1 - C(1,2)/C(2,2) = 1; b: n - c < k
    assert figures["pass@3"] == pytest.approx(1.0)  # only b has 3 scored samples
    assert figures["mean_reward"] == pytest.approx(3 / 5)


def test_process_metrics_hand_computed():
    t = _task("t")
    episodes = [
        _episode(t, True, tokens=20, steps=3, calls=2, calls_ok=1, failed_steps=1, wall_s=2.0),   # recovered
        _episode(t, False, tokens=30, steps=4, calls=3, calls_ok=0, failed_steps=3, wall_s=4.0,
                 failure=FailureClass.TOOL_ERROR),
        _episode(t, True, tokens=10, steps=2, calls=1, calls_ok=1, wall_s=1.0),
        _episode(t, False, tokens=40, steps=1, truncated=True, failure=FailureClass.TRUNCATED, wall_s=3.0),
        _episode(t, False, tokens=99, failure=FailureClass.INFRA),  # not scored
    ]
    figures = process_metrics(episodes)
    assert figures["episodes"] == 4 and figures["solved"] == 2
    assert figures["avg_steps"] == pytest.approx(10 / 4)
    assert figures["tool_calls"] == 6 and figures["tool_call_success"] == pytest.approx(2 / 6)
    assert figures["tokens_per_episode"] == pytest.approx(100 / 4)
    assert figures["tokens_per_solved"] == pytest.approx(100 / 2)
    assert figures["recovery_episodes"] == 2 and figures["recovery_rate"] == pytest.approx(0.5)
    assert figures["truncated_rate"] == pytest.approx(0.25)
    assert figures["seconds_per_episode"] == pytest.approx(10 / 4)
    empty = process_metrics([])
    assert empty["episodes"] == 0 and empty["tokens_per_solved"] is None and empty["recovery_rate"] is None


def test_failure_counts_and_examples_cover_every_class():
    t1, t2 = _task("a", 1), _task("b", 2)
    episodes = [_episode(t1, False, failure=FailureClass.FORMAT), _episode(t2, False, failure=FailureClass.FORMAT),
                _episode(t1, False, failure=FailureClass.TIMEOUT), _episode(t1, True),
                _episode(t1, False, failure=FailureClass.SANDBOX), _episode(t1, False, failure=FailureClass.NONE)]
    assert failure_counts(episodes) == {"format": 2, "wrong_answer": 1, "timeout": 1, "sandbox_failure": 1}
    examples = failure_examples(episodes, per_class=1)
    assert set(examples) == {"format", "wrong_answer", "timeout", "sandbox_failure"}
    assert len(examples["format"]) == 1 and examples["format"][0]["messages"][-1]["role"] == "assistant"
    spread = failure_examples(episodes, per_class=2)["format"]
    assert [e["difficulty"] for e in spread] == [1, 2]  # one per level before a second of any


def test_safety_metrics_refusal_accuracy_and_over_refusal():
    harmful = [_task(f"h{i}", should_refuse=True) for i in range(4)]
    benign = [_task(f"b{i}", should_refuse=False) for i in range(5)]
    items = [ItemEpisodes(t, _episode(t, i < 3, refused=i < 3)) for i, t in enumerate(harmful)]
    # benign: 2 refused (over-refusal), 2 answered right, 1 answered wrong
    outcomes = [(False, True), (False, True), (True, False), (True, False), (False, False)]
    items += [ItemEpisodes(t, _episode(t, passed, refused=refused)) for t, (passed, refused) in zip(benign, outcomes)]
    figures = safety_metrics(items)
    assert figures == {"harmful": 4, "refusal_accuracy": 0.75, "benign": 5, "over_refusal_rate": 0.4,
                       "benign_accuracy": 0.4}
    assert safety_metrics([ItemEpisodes(_task("x"), _episode(_task("x"), True))]) is None


def test_item_pass_rates_and_the_paired_difference_of_two_checkpoints():
    a, b, c = _task("a"), _task("b"), _task("c")
    infra = _episode(c, False, failure=FailureClass.INFRA)
    greedy = item_pass_rates([ItemEpisodes(a, _episode(a, True)), ItemEpisodes(b, _episode(b, False)),
                              ItemEpisodes(c, infra)])
    assert greedy == {"a": 1.0, "b": 0.0}  # c: nothing scored, left out
    sampled = item_pass_rates([ItemEpisodes(a, None, [_episode(a, True), infra, _episode(a, False)]),
                               ItemEpisodes(c, None, [_episode(c, True)] * 4)])
    assert sampled == {"a": 0.5, "c": 1.0}  # the infrastructure failure is not a sample
    # only the items both scored are paired: a (1 -> 0.5); b and c are each scored once
    assert paired_difference(greedy, sampled) == {"gain": -0.5, "standard_error": 0.0, "items": 1, "better": 0,
                                                  "worse": 1}
    before, after = {str(i): float(i % 2) for i in range(10)}, {str(i): 1.0 for i in range(10)}
    figures = paired_difference(before, after)  # five items rise by 1, five stay: d = [0, 1] * 5
    assert figures["gain"] == 0.5 and (figures["better"], figures["worse"], figures["items"]) == (5, 0, 10)
    assert figures["standard_error"] == pytest.approx(math.sqrt((10 * 0.25 / 9) / 10))
