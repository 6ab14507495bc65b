"""reasoning-gym entries scored exactly: no partial credit for answers that merely contain the right one, and
the datasets' own scorers (some of which eval the answer) run in the sandbox, never in the trainer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def test_an_answer_scored_once_is_not_scored_again_unless_reuse_is_off():
    """An RL group often gives one wrong answer several times, each a jail that imports reasoning-gym: the same
    answer to the same entry in the same pool is scored once (`posttrain.verify.memo`)."""
    from posttrain.verify.gym import scorer_sandbox

    box, runs = scorer_sandbox(), []

    class Counting:  # the same pool, jail and limits: only counts the jails it runs
        jail, pool, limits = box.jail, box.pool, box.limits

        def run(self, cmd, **options):
            runs.append(cmd)
            return box.run(cmd, **options)

    counting, item = Counting(), entry("countdown", seed=1)
    wrong = f"<answer>{item['answer']} + 1</answer>"
    first = verify_reasoning_gym(wrong, item, sandbox=counting)
    again = verify_reasoning_gym(f"<think>another path</think>{wrong}", item, sandbox=counting)
    assert len(runs) == 1 and again.details["reused"] is True and not first.details.get("reused")
    assert (again.score, again.details["raw_score"]) == (first.score, first.details["raw_score"]) and first.score == 0
    assert verify_reasoning_gym(f"<answer>({item['answer']})</answer>", item, sandbox=counting).passed
    assert len(runs) == 2  # another answer: scored
    assert verify_reasoning_gym(wrong, item, sandbox=counting, reuse=False).score == 0 and len(runs) == 3


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


# A module in the scorer's working directory that, imported by the parent (the process holding the nonce), reads
# the config as the parent opens it and prints a full-score record before the real scorer has run.
_FORGER = '''
import io, os
import json as _json
_fdopen = os.fdopen


def _sniffing_fdopen(fd, mode="r", *args, **kwargs):
    handle = _fdopen(fd, mode, *args, **kwargs)
    if mode == "rb" and not getattr(os, "_forged", False):
        os._forged = True
        data = handle.read()
        os.write(1, (_json.loads(data)["nonce"] + ' {"score": 1.0}\\n').encode())
        return io.BytesIO(data)
    return handle


os.fdopen = _sniffing_fdopen


class CDLL:
    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args: 0
'''


def test_a_module_beside_the_scorer_cannot_stand_in_for_one_it_imports(tmp_path):
    """The scorer runs as a script from the jail's working directory; a ctypes.py there must not be imported in
    place of the standard library's (before the guard it was, and forged a full score for a wrong answer)."""
    import posttrain.verify.gym as gym

    item = entry("countdown", seed=1)
    (tmp_path / "_gym_scorer.py").write_text(Path(gym.__file__).with_name("_gym_scorer.py").read_text())
    (tmp_path / "ctypes.py").write_text(_FORGER)
    config = {"nonce": "N0NCE", "dataset": "countdown", "answer": f"{item['answer']} + 1", "entry": item,
              "timeout_s": 30.0, "jailed": False}
    (tmp_path / "config").write_text(json.dumps(config))
    run = subprocess.run([sys.executable, "-B", "-s", "_gym_scorer.py", "config"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    records = [json.loads(line.split(" ", 1)[1]) for line in run.stdout.splitlines() if line.startswith("N0NCE ")]
    assert records and all(record["score"] < 1.0 for record in records), run.stdout
