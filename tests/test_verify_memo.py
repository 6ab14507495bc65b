"""The judgement memo on its own (verify/memo.py): one judgement per key at a time, verdicts kept and bounded,
errors and infrastructure failures never handed on. The code verifier's use of it is in test_verify_code.py."""

from __future__ import annotations

import threading

import pytest

from posttrain.types import FailureClass, Reward
from posttrain.verify.memo import JudgementMemo, judgement_key


def test_callers_that_arrive_while_a_judgement_runs_wait_for_its_verdict():
    memo, release, runs = JudgementMemo(), threading.Event(), []

    def slow():
        runs.append(1)
        release.wait(10)
        return Reward(0.5, False, FailureClass.WRONG_ANSWER, details={"cases": ["pass", "wrong output"]})

    got = []
    threads = [threading.Thread(target=lambda: got.append(memo.judge("k", slow))) for _ in range(6)]
    for thread in threads:
        thread.start()
    release.set()
    for thread in threads:
        thread.join(10)
    assert len(runs) == 1 and len(got) == 6 and {r.score for r in got} == {0.5}
    assert sorted(bool(r.details.get("reused")) for r in got) == [False] + [True] * 5
    assert len({id(r.details) for r in got}) == 6  # each caller its own details


def test_infrastructure_failures_and_errors_are_never_kept():
    memo, judged = JudgementMemo(), []

    def judging(verdict):
        def judge():
            judged.append(verdict)
            if verdict is None:
                raise RuntimeError("the verifier's own bug")
            return verdict
        return judge

    assert memo.judge("k", judging(Reward(0.0, False, FailureClass.SANDBOX))).is_infrastructure_failure
    assert memo.judge("k", judging(Reward(1.0, True))).passed  # judged again, then kept
    assert memo.judge("k", judging(Reward(0.0, False))).details["reused"] is True
    with pytest.raises(RuntimeError):
        memo.judge("e", judging(None))
    assert memo.judge("e", judging(Reward(1.0, True))).passed and len(judged) == 4


def test_the_memo_keeps_the_most_recently_used_verdicts_only():
    memo = JudgementMemo(size=2)
    for key in ("a", "b"):
        memo.judge(key, lambda: Reward(1.0, True))
    memo.judge("a", lambda: Reward(0.0, False))  # "a" used again: "b" is now the oldest
    memo.judge("c", lambda: Reward(1.0, True))
    assert memo.judge("a", lambda: Reward(0.0, False)).details.get("reused")
    assert not memo.judge("b", lambda: Reward(0.0, False)).details.get("reused")


def test_keys_differ_whenever_a_part_does():
    base = judgement_key({"cases": [1, 2]}, b"def f(): pass", 4.0)
    assert base == judgement_key({"cases": [1, 2]}, b"def f(): pass", 4.0)
    assert len({base, judgement_key({"cases": [1, 3]}, b"def f(): pass", 4.0),
                judgement_key({"cases": [1, 2]}, b"def f(): pass ", 4.0),
                judgement_key({"cases": [1, 2]}, b"def f(): pass", 4.5),
                judgement_key({"cases": [1, 2]}, b"def f(): pa", b"ss", 4.0)}) == 5
