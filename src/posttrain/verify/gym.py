"""reasoning-gym entries, scored exactly: 1 for a correct answer, 0 for anything else - no partial credit.

33 of reasoning-gym's 106 scorers give partial credit when the answer merely *contains* the right one (one
example scored 0.965): trained on, that teaches padding. So the reward is 1 only when the answer equals the
entry's ``answer`` after stripping, or when the dataset's own scorer returns exactly 1.0 (datasets with several
correct answers: countdown, n-queens ...). The raw scorer value is kept in details.
Several of those scorers ``eval`` the answer text, so the scorer runs in the sandbox (`_gym_scorer.py`) with
the trainer's interpreter bound read-only, never in the trainer; answers carrying Python introspection or
code-execution names are refused before they reach it.
The answer is read from ``<answer>...</answer>`` (reasoning-gym's convention; several different ones score 0),
else ``\\boxed{}``, else the whole text after any ``<think>`` block.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import sys
from typing import Any

from posttrain.sandbox import JailOptions, Limits, Sandbox, python_runtime_paths
from posttrain.types import FailureClass, Reward
from posttrain.verify.channel import new_nonce, read_record, runs_in_jail
from posttrain.verify.completion import strip_reasoning, tagged
from posttrain.verify.errors import VerifyError
from posttrain.verify.math_answer import boxed_answers
from posttrain.verify.memo import judged_once
from posttrain.verify.registry import verifier

_SCORER_SOURCE = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_gym_scorer.py")).read()
_UNSAFE = re.compile(r"__|\b(?:import|exec|eval|compile|open|getattr|setattr|delattr|globals|locals|vars|dir|"
                     r"lambda|breakpoint|input|help|type|object|super|memoryview|os|sys|subprocess)\b")
_MAX_ANSWER_CHARS = 4000


def _answers(text: str) -> list[str]:
    body = strip_reasoning(text)
    in_tags = [a.strip() for a in tagged(body, "<answer>", "</answer>")]
    if in_tags:
        return in_tags
    boxed = [a.strip() for a in boxed_answers(body)]
    return boxed or [body.strip()]


def _check_gym_args(entry: Any = None, dataset: Any = None, **_: Any) -> None:
    if not isinstance(entry, dict) or "answer" not in entry:
        raise VerifyError("verifier 'reasoning_gym': entry must be a reasoning-gym dataset entry (a dict with "
                          "'question', 'answer' and 'metadata')")
    name = dataset or (entry.get("metadata") or {}).get("source_dataset")
    if not isinstance(name, str) or not name:
        raise VerifyError("verifier 'reasoning_gym': no dataset name: pass dataset= or keep "
                          "entry['metadata']['source_dataset']")
    try:
        json.dumps(entry)
    except (TypeError, ValueError) as error:
        raise VerifyError(f"verifier 'reasoning_gym': entry is not JSON data: {error}") from None


def scorer_sandbox() -> Sandbox:
    """A jail that can import reasoning_gym: this interpreter and its packages, bound read-only."""
    jail = JailOptions(python=sys.executable, ro_paths=python_runtime_paths(sys.executable))
    return Sandbox(Limits(timeout_s=60, cpu_s=60, memory_mb=1024, processes=32), jail=jail)


@verifier("reasoning_gym", check=_check_gym_args)
def verify_reasoning_gym(completion: str, entry: dict[str, Any], *, dataset: str | None = None,
                         use_scorer: bool = True, timeout_s: float = 30.0, sandbox: Sandbox | None = None,
                         infra_retries: int = 2, final_state: dict[str, Any] | None = None,
                         reuse: bool = True) -> Reward:
    """1 if the answer is exactly right (or the dataset's scorer gives exactly 1.0), else 0. With `reuse`, an
    answer the scorer judged already for this entry in this sandbox pool is not judged again
    (`posttrain.verify.memo`: an RL group often gives one wrong answer several times, each a jail that imports
    reasoning-gym)."""
    _check_gym_args(entry, dataset)
    name = dataset or entry["metadata"]["source_dataset"]
    answers = set(_answers(completion))
    if len(answers) != 1 or not next(iter(answers)):
        reason = "multiple_answers" if len(answers) > 1 else "no_answer"
        return Reward(0.0, False, FailureClass.FORMAT if reason == "no_answer" else FailureClass.WRONG_ANSWER,
                      details={"reason": reason, "dataset": name})
    (answer,) = answers
    details: dict[str, Any] = {"dataset": name, "answer": answer[:200]}
    if answer == str(entry["answer"]).strip():
        return Reward(1.0, True, details={**details, "method": "exact"})
    if not use_scorer:
        return Reward(0.0, False, FailureClass.WRONG_ANSWER, details={**details, "method": "exact"})
    if len(answer) > _MAX_ANSWER_CHARS or _UNSAFE.search(answer):
        return Reward(0.0, False, FailureClass.WRONG_ANSWER, details={**details, "reason": "unsafe_answer"})
    box = sandbox or scorer_sandbox()
    judge = functools.partial(_score, box, name, answer, entry, details, timeout_s, infra_retries)
    return judged_once(box, reuse, judge, "reasoning_gym", name, answer, entry, timeout_s,
                       repr(getattr(box, "limits", None)))


def _score(box: Any, name: str, answer: str, entry: dict[str, Any], details: dict[str, Any], timeout_s: float,
           infra_retries: int) -> Reward:
    """The dataset's scorer on `answer`, in a jail of `box`."""
    nonce = new_nonce()
    config_name = f".config-{secrets.token_hex(8)}"
    config = {"nonce": nonce, "dataset": name, "answer": answer, "entry": entry, "timeout_s": timeout_s}
    config["jailed"] = runs_in_jail(box)
    for attempt in range(infra_retries + 1):
        result = box.run([box.jail.python, "-B", "-s", "_gym_scorer.py", config_name],
                         files={"_gym_scorer.py": _SCORER_SOURCE, config_name: json.dumps(config)},
                         timeout_s=timeout_s + 10.0)
        if not result.is_infra_error:
            break
    if result.is_infra_error:
        return Reward(0.0, False, FailureClass.SANDBOX, details={**details, "error": result.error[-300:]})
    record = read_record(result, nonce)
    if record is None:
        return Reward(0.0, False, FailureClass.WRONG_ANSWER,
                      details={**details, "reason": "scorer_failed", "status": str(result.status)})
    raw = float(record.get("score", 0.0))
    details = {**details, "method": "scorer", "raw_score": raw}
    if raw >= 1.0:
        return Reward(1.0, True, details=details)
    return Reward(0.0, False, FailureClass.WRONG_ANSWER, details=details)
