"""Math answers: find the one final answer, refuse hedges, compare exactly when the reference is rational.

The final answer is the content of ``\\boxed{}`` (or ``\\fbox{}``); without a box, a stated answer line
(``Answer: 12``, ``The final answer is 12``, ``#### 12``). Scored 0:
* several different final answers (two boxes that disagree, two answer lines that disagree);
* hedges: "3 or 4", "either", "maybe", "approximately", a question mark, ``\\pm`` the reference does not have;
* answer lists: more top-level comma/semicolon/"and"-separated items than the reference has;
* an empty box, and answers longer than ``max_answer_chars`` (default: 3x the reference + 16, at least 32).
Comparison: when both the reference and the answer are plain rational expressions, `fractions.Fraction`
equality (exact: 1/2^99 is not 1/2^98); otherwise math-verify (LaTeX parsing only) in a worker process killed
after ``timeout_s``, still requiring exact equality when the reference is rational.
"""

from __future__ import annotations

import re
from typing import Any

from posttrain.types import FailureClass, Reward
from posttrain.verify.completion import strip_reasoning
from posttrain.verify.errors import VerifyError
from posttrain.verify.math_rational import normalize, parse_rational
from posttrain.verify.math_worker import math_workers
from posttrain.verify.registry import verifier

_BOX = re.compile(r"\\(?:boxed|fbox)\b\s*")
_ANSWER_LINE = re.compile(r"(?im)^[ \t>*#_]*(?:final\s+answer|answer)\s*(?:is)?\s*[:：=][ \t]*(.+)$")
_ANSWER_IS = re.compile(r"(?im)\b(?:the\s+)?(?:final\s+)?answer\s+is\s*[:：]?\s*(.+?)(?:\.(?:\s|$)|$)")
_GSM = re.compile(r"(?m)^[ \t]*####[ \t]*(.+)$")
_HEDGE = re.compile(
    r"\bor\b|\\lor\b|\\vee\b|\bnor\b|\beither\b|\bmaybe\b|\bperhaps\b|\bprobably\b|\bpossibly\b|\blikely\b"
    r"|\bapprox|\\approx|≈|\\sim\b|\?|\band/or\b",
    re.IGNORECASE,
)
_WRAPPERS = re.compile(r"^\\(?:text|textbf|mathrm|mathbf)\{(.*)\}$", re.DOTALL)


def boxed_answers(text: str) -> list[str]:
    """The contents of every ``\\boxed{...}``/``\\fbox{...}``, braces balanced (``\\boxed 5`` also works).

    One pass: a box inside a box is part of the outer answer, and an unclosed box ends the scan (everything
    after it is inside it), so a text of a thousand unclosed boxes costs what one does."""
    answers, position = [], 0
    while True:
        match = _BOX.search(text, position)
        if match is None:
            return answers
        start = match.end()
        if start < len(text) and text[start] == "{":
            depth, index = 0, start
            while index < len(text):
                char = text[index]
                if char == "\\":
                    index += 2
                    continue
                depth += char == "{"
                depth -= char == "}"
                if depth == 0:
                    break
                index += 1
            if depth != 0:
                answers.append("")
                return answers
            answers.append(text[start + 1:index])
            position = index + 1
        else:
            token = re.match(r"[^\s$]+", text[start:start + 200])
            answers.append(token.group(0) if token else "")
            position = start


def stated_answers(text: str) -> list[str]:
    """Answers from the text: the boxes if there are any, else every stated answer line."""
    body = strip_reasoning(text)
    boxes = boxed_answers(body)
    if boxes:
        return boxes
    lines = [m.group(1) for pattern in (_ANSWER_LINE, _ANSWER_IS, _GSM) for m in pattern.finditer(body)]
    return [line.rstrip().rstrip(".").rstrip() for line in lines]


def _clean(answer: str) -> str:
    answer = answer.strip().strip("$").strip()
    wrapped = _WRAPPERS.match(answer)
    return wrapped.group(1).strip() if wrapped else answer


def _top_level_items(text: str) -> int:
    """How many comma/semicolon/'and'-separated items `text` lists outside brackets."""
    flat = normalize(text) if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", text.strip()) else text
    flat = re.sub(r"\\[{}]", "", flat)
    depth, items = 0, 1
    for index, char in enumerate(flat):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif depth == 0 and char in ",;":
            items += 1
    return items + len(re.findall(r"(?:\s|\\text\{\s*)and\b", flat))


def _same_answer(a: str, b: str) -> bool:
    if normalize(a) == normalize(b):
        return True
    qa, qb = parse_rational(a), parse_rational(b)
    return qa is not None and qa == qb


def _zero(failure: FailureClass, reason: str, **details: Any) -> Reward:
    return Reward(score=0.0, passed=False, failure=failure, details={"reason": reason, **details})


def _check_math_args(reference: Any = None, **_: Any) -> None:
    if not isinstance(reference, (str, int, float)) or isinstance(reference, bool) or str(reference).strip() == "":
        raise VerifyError(f"verifier 'math': reference must be a non-empty string or number, got {reference!r}")


@verifier("math", check=_check_math_args)
def verify_math(completion: str, reference: str | int | float, *, timeout_s: float = 5.0,
                max_answer_chars: int | None = None, final_state: dict | None = None) -> Reward:
    """Score 1 if the completion's single final answer equals `reference`, else 0 (see the module doc)."""
    _check_math_args(reference)
    reference = str(reference).strip()
    answers = [_clean(a) for a in stated_answers(completion)]
    if not answers:
        return _zero(FailureClass.FORMAT, "no_final_answer")
    first = answers[0]
    if any(not _same_answer(first, other) for other in answers[1:]):
        return _zero(FailureClass.WRONG_ANSWER, "multiple_answers", answers=answers[:5])
    answer = first
    details: dict[str, Any] = {"answer": answer[:200], "reference": reference}
    if not answer:
        return _zero(FailureClass.FORMAT, "empty_answer", **details)
    limit = max_answer_chars or max(32, 3 * len(reference) + 16)
    if len(answer) > limit:
        return _zero(FailureClass.WRONG_ANSWER, "answer_too_long", limit=limit, **details)
    if _HEDGE.search(answer) and not _HEDGE.search(reference):
        return _zero(FailureClass.WRONG_ANSWER, "hedged_answer", **details)
    if "\\pm" in answer and "\\pm" not in reference or "\\mp" in answer and "\\mp" not in reference:
        return _zero(FailureClass.WRONG_ANSWER, "hedged_answer", **details)
    if _top_level_items(answer) > _top_level_items(reference):
        return _zero(FailureClass.WRONG_ANSWER, "answer_list", **details)

    exact = parse_rational(reference)
    if exact is not None:
        guess = parse_rational(answer)
        if guess is not None:
            return _judged(guess == exact, "exact_rational", details)
    if normalize(answer) == normalize(reference):
        return _judged(True, "same_text", details)
    rational = (exact.numerator, exact.denominator) if exact is not None else None
    verdict = math_workers().check(reference, answer, rational, timeout_s)
    if verdict == "timeout":
        return _zero(FailureClass.TIMEOUT, "comparison_timeout", timeout_s=timeout_s, **details)
    if verdict == "infra":
        return _zero(FailureClass.INFRA, "math_worker_failed", **details)
    return _judged(verdict == "equal", "math_verify", details)


def _judged(correct: bool, method: str, details: dict[str, Any]) -> Reward:
    details = {**details, "method": method}
    if correct:
        return Reward(score=1.0, passed=True, details=details)
    return Reward(score=0.0, passed=False, failure=FailureClass.WRONG_ANSWER, details=details)
