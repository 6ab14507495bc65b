"""Exact answers: the completion (or the part `extract` names) equals the reference after normalization.

Normalization: Unicode NFKC, surrounding whitespace and one trailing period dropped, inner whitespace collapsed,
case-folded unless ``case_sensitive``. A leading ``<think>...</think>`` block is never part of the answer.
``extract``: ``"all"`` (the whole remaining text, the default: ``632`` for ``347+285``), ``"last_line"``,
``"boxed"`` (the single ``\\boxed{}``; several different ones score 0) or ``"answer_tag"``
(``<answer>...</answer>``). Made for arithmetic and other tasks with one canonical answer string.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from posttrain.types import FailureClass, Reward
from posttrain.verify.completion import strip_reasoning, tagged
from posttrain.verify.errors import VerifyError
from posttrain.verify.math_answer import boxed_answers
from posttrain.verify.registry import verifier

EXTRACTORS = ("all", "last_line", "boxed", "answer_tag")


def normalize_answer(text: str, case_sensitive: bool = False) -> str:
    text = re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text)).strip()
    text = text[:-1].rstrip() if text.endswith(".") else text
    return text if case_sensitive else text.casefold()


def extract_answer(text: str, extract: str) -> list[str]:
    """The candidate answers `extract` finds (several means the model gave several)."""
    body = strip_reasoning(text)
    if extract == "all":
        return [body]
    if extract == "last_line":
        lines = [line for line in body.splitlines() if line.strip()]
        return lines[-1:] if lines else []
    if extract == "boxed":
        return boxed_answers(body)
    return tagged(body, "<answer>", "</answer>")


def _check_exact_args(answer: Any = None, extract: str = "all", **_: Any) -> None:
    if not isinstance(answer, (str, int)) or isinstance(answer, bool):
        raise VerifyError(f"verifier 'exact': answer must be a string (or an int), got {answer!r}")
    if extract not in EXTRACTORS:
        raise VerifyError(f"verifier 'exact': extract must be one of {', '.join(EXTRACTORS)}, got {extract!r}")


@verifier("exact", check=_check_exact_args, blocking=False)
def verify_exact(completion: str, answer: str | int, *, case_sensitive: bool = False, extract: str = "all",
                 final_state: dict[str, Any] | None = None) -> Reward:
    """1 if the extracted answer equals `answer` after normalization, else 0."""
    _check_exact_args(answer, extract)
    found = {normalize_answer(a, case_sensitive) for a in extract_answer(completion, extract)}
    expected = normalize_answer(str(answer), case_sensitive)
    if not found or found == {""}:
        return Reward(0.0, False, FailureClass.FORMAT, details={"reason": "no_answer"})
    if len(found) > 1:
        return Reward(0.0, False, FailureClass.WRONG_ANSWER, details={"reason": "multiple_answers"})
    (got,) = found
    if got == expected:
        return Reward(1.0, True, details={"answer": got[:200]})
    return Reward(0.0, False, FailureClass.WRONG_ANSWER, details={"answer": got[:200], "expected": expected[:200]})
