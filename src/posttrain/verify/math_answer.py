"""Math answers: find the final answer, refuse hedges, compare item by item, exactly when the reference is rational.

The final answer is the content of ``\\boxed{}`` (or ``\\fbox{}``); without a box, a stated answer line
(``Answer: 12``, ``The final answer is 12``, ``#### 12``). The reference and the answer are split into items
(`posttrain.verify.math_items`): a reference with several items is a list of solutions (``1, 2, 3``,
``a=4,-8,-10``, ``(11,7) \\text{ or } (7,11)``, ``\\{1, 2\\}``, ``1 \\pm \\sqrt{3}``), compared unordered, and
its answer may come in several boxes, separated by "or"/"and", or with ``\\pm``; a pair, an interval, a vector
is one item and keeps its order. Scored 0:
* several different final answers when the reference is one item (two boxes or answer lines that disagree);
* hedges: "3 or 4" (for one item), "either", "maybe", "approximately", "at least", "and more", a question mark,
  ``\\pm`` the reference does not have (for one item; for a list of solutions it stands for two);
* answer lists: more items than the reference has (``\\boxed{1, 2, 3}`` for ``2``; a fourth box for three roots);
* an empty box, and answers longer than ``max_answer_chars`` (default: 3x the reference + 16, at least 32).
Comparison per item: text answers as text (``\\text{Evelyn}``, ``(C)``); after dropping thousands separators and
units, when both sides are plain rational expressions, `fractions.Fraction` equality (exact: 1/2^99 is not
1/2^98); otherwise math-verify (LaTeX parsing only) in a worker process killed after ``timeout_s`` (the unsettled
pairs of a solution set go in one request), still requiring exact equality when the reference item is rational.
"""

from __future__ import annotations

import re
from typing import Any

from posttrain.types import FailureClass, Reward
from posttrain.verify.completion import strip_reasoning
from posttrain.verify.errors import VerifyError
from posttrain.verify.math_items import PLUS_MINUS, answer_items, text_answer, tidy
from posttrain.verify.math_rational import normalize, parse_rational
from posttrain.verify.math_worker import math_workers
from posttrain.verify.registry import verifier

_BOX = re.compile(r"\\(?:boxed|fbox)\b\s*")
_ANSWER_LINE = re.compile(r"(?im)^[ \t>*#_]*(?:final\s+answer|answer)\s*(?:is)?\s*[:：=][ \t]*(.+)$")
_ANSWER_IS = re.compile(r"(?im)\b(?:the\s+)?(?:final\s+)?answer\s+is\s*[:：]?\s*(.+?)(?:\.(?:\s|$)|$)")
_GSM = re.compile(r"(?m)^[ \t]*####[ \t]*(.+)$")
_HEDGE = re.compile(
    r"\bor\b|\\lor\b|\\vee\b|\bnor\b|\beither\b|\bmaybe\b|\bperhaps\b|\bprobably\b|\bpossibly\b|\blikely\b"
    r"|\bapprox|\\approx|≈|\\sim\b|\?|\band/or\b|(?<!\\)\bto\b|\bbetween\b|\bat\s+(?:least|most)\b|\bnot\b"
    r"|\bexcept\b|\b(?:more|less|fewer|greater|smaller)\s+than\b|\b(?:more|less|fewer|above|below|if|unless)\b",
    re.IGNORECASE,
)
_COMMAND = re.compile(r"\\[A-Za-z]+")
_LETTERS = re.compile(r"[A-DF-HJ-Za-df-hj-z]")  # letters but e and i, after dropping commands
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


def _hedges(text: str, *, separators: bool) -> set[str]:
    """The hedge words in `text`, lower-cased; with `separators`, "or" separates solutions and is no hedge."""
    found = {re.sub(r"\s+", " ", m.group(0).lower()) for m in _HEDGE.finditer(text)}
    return found - {"or"} if separators else found


def _cheap_equal(reference: str, answer: str) -> tuple[bool | None, str]:
    """(verdict, method) when an item pair is decided here - text answers, the same text, exact rationals -
    or (None, "math_verify") when math-verify must decide."""
    text = text_answer(reference)
    if text is not None:
        return text == text_answer(answer), "text"
    reference, answer = tidy(reference), tidy(answer)
    flat = normalize(reference)
    if flat and flat == normalize(answer):
        return True, "same_text"
    exact, guess = parse_rational(reference), parse_rational(answer)
    if exact is not None and guess is not None:
        return exact == guess, "exact_rational"
    if exact is not None and _LETTERS.search(_COMMAND.sub("", answer)):
        return False, "exact_rational"  # a number is not "5ab" (math-verify reads the letters as a unit and drops them)
    return None, "math_verify"


def _same_answer(a: str, b: str) -> bool:
    return _cheap_equal(a, b)[0] is True


def _distinct(answers: list[str], at_most: int) -> list[str]:
    """The stated answers without repeats (the same answer boxed twice is one answer), at most `at_most` + 1."""
    distinct: list[str] = []
    for answer in dict.fromkeys(answers):  # the same text boxed a thousand times is compared once
        if not any(_same_answer(seen, answer) for seen in distinct):
            distinct.append(answer)
            if len(distinct) > at_most:
                break
    return distinct


def _unique_items(items: list[tuple[str | None, str]]) -> list[tuple[str | None, str]]:
    unique: list[tuple[str | None, str]] = []
    for label, value in items:
        if not any(label == seen_label and (value == seen or _same_answer(seen, value)) for seen_label, seen in unique):
            unique.append((label, value))
    return unique


def _zero(failure: FailureClass, reason: str, **details: Any) -> Reward:
    return Reward(score=0.0, passed=False, failure=failure, details={"reason": reason, **details})


def _check_math_args(reference: Any = None, **_: Any) -> None:
    if not isinstance(reference, (str, int, float)) or isinstance(reference, bool) or str(reference).strip() == "":
        raise VerifyError(f"verifier 'math': reference must be a non-empty string or number, got {reference!r}")


@verifier("math", check=_check_math_args)
def verify_math(completion: str, reference: str | int | float, *, timeout_s: float = 5.0,
                max_answer_chars: int | None = None, final_state: dict | None = None) -> Reward:
    """Score 1 if the completion's final answer equals `reference`, else 0 (see the module doc)."""
    _check_math_args(reference)
    reference = str(reference).strip()
    answers = [_clean(a) for a in stated_answers(completion)]
    if not answers:
        return _zero(FailureClass.FORMAT, "no_final_answer")
    limit = max_answer_chars or max(32, 3 * len(reference) + 16)
    if any(len(a) > limit for a in answers):  # before comparing them: the boxes are the model's, any length
        return _zero(FailureClass.WRONG_ANSWER, "answer_too_long", limit=limit,
                     answer=next(a for a in answers if len(a) > limit)[:200], reference=reference)
    expected = _unique_items(answer_items(reference))
    several = len(expected) > 1  # a list of solutions: unordered, several boxes may hold it
    distinct = _distinct(answers, at_most=len(expected) if several else 1)
    if len(distinct) > 1 and (not several or "" in distinct):
        return _zero(FailureClass.WRONG_ANSWER, "multiple_answers", answers=answers[:5])
    answer = ", ".join(distinct)
    details: dict[str, Any] = {"answer": answer[:200], "reference": reference}
    if not answer:
        return _zero(FailureClass.FORMAT, "empty_answer", **details)
    if len(answer) > limit:
        return _zero(FailureClass.WRONG_ANSWER, "answer_too_long", limit=limit, **details)
    if _hedges(answer, separators=several) - _hedges(reference, separators=several):
        return _zero(FailureClass.WRONG_ANSWER, "hedged_answer", **details)
    if not several and ("\\pm" in answer and "\\pm" not in reference or "\\mp" in answer and "\\mp" not in reference):
        return _zero(FailureClass.WRONG_ANSWER, "hedged_answer", **details)
    items = _unique_items([item for stated in distinct for item in answer_items(stated)])
    if len(items) > len(expected):
        return _zero(FailureClass.WRONG_ANSWER, "answer_list", **details)
    if any(PLUS_MINUS.search(value) for _, value in items) and not PLUS_MINUS.search(reference):
        return _zero(FailureClass.WRONG_ANSWER, "hedged_answer", **details)  # several signs, not expanded
    if several:
        verdict = _same_set(expected, items, timeout_s)
        method = "solution_set"
    else:
        verdict, method = _same_item(expected[0], items[0], timeout_s)
    if verdict == "timeout":
        return _zero(FailureClass.TIMEOUT, "comparison_timeout", timeout_s=timeout_s, **details)
    if verdict == "infra":
        return _zero(FailureClass.INFRA, "math_worker_failed", **details)
    return _judged(verdict is True, method, details)


def _labels_clash(reference: tuple[str | None, str], answer: tuple[str | None, str]) -> bool:
    return reference[0] is not None and answer[0] is not None and reference[0] != answer[0]


def _rational_of(item: str) -> tuple[int, int] | None:
    exact = parse_rational(tidy(item))
    return (exact.numerator, exact.denominator) if exact is not None else None


def _same_item(reference: tuple[str | None, str], answer: tuple[str | None, str],
               timeout_s: float) -> tuple[bool | str, str]:
    if _labels_clash(reference, answer):
        return False, "label"
    cheap, method = _cheap_equal(reference[1], answer[1])
    if cheap is not None:
        return cheap, method
    verdict = math_workers().check(tidy(reference[1]), tidy(answer[1]), _rational_of(reference[1]), timeout_s)
    return (verdict if verdict in ("timeout", "infra") else verdict == "equal"), method


def _same_set(expected: list[tuple[str | None, str]], items: list[tuple[str | None, str]],
              timeout_s: float) -> bool | str:
    """Whether the items are the expected ones in some order (in order when the reference names distinct
    unknowns, x=1, y=2, and the answer does not - but x_1, x_2 are roots in any order): cheap verdicts first,
    the rest in one math-verify batch."""
    if len(items) != len(expected):
        return False
    labels = [label for label, _ in expected]
    family = {label.split("_")[0] for label in labels if label and "_" in label}  # x_1, x_2: roots, unordered
    in_order = (None not in labels and len(set(labels)) == len(labels) and any(label is None for label, _ in items)
                and not (len(family) == 1 and all("_" in label for label in labels)))
    equal: list[list[bool | None]] = [
        [False if (in_order and i != j) or _labels_clash(ref, ans) else _cheap_equal(ref[1], ans[1])[0]
         for j, ans in enumerate(items)] for i, ref in enumerate(expected)]
    match = _matching(equal)
    unmatched_rows = [i for i in range(len(expected)) if i not in match.values()]
    unmatched_cols = [j for j in range(len(items)) if j not in match]
    open_pairs = [(i, j) for i in unmatched_rows for j in unmatched_cols if equal[i][j] is None]
    if not unmatched_rows:
        return True
    if not open_pairs:
        return False
    verdicts = math_workers().check_pairs(
        [(tidy(expected[i][1]), tidy(items[j][1]), _rational_of(expected[i][1])) for i, j in open_pairs], timeout_s)
    if isinstance(verdicts, str):
        return verdicts
    for (i, j), verdict in zip(open_pairs, verdicts):
        equal[i][j] = verdict
    return len(_matching(equal)) == len(expected)


def _matching(equal: list[list[bool | None]]) -> dict[int, int]:
    """A maximum matching of reference rows to answer columns over the True cells (augmenting paths; k is small)."""
    owner: dict[int, int] = {}  # column -> row

    def augment(row: int, seen: set[int]) -> bool:
        for column, value in enumerate(equal[row]):
            if value is True and column not in seen:
                seen.add(column)
                if column not in owner or augment(owner[column], seen):
                    owner[column] = row
                    return True
        return False

    for row in range(len(equal)):
        augment(row, set())
    return owner


def _judged(correct: bool, method: str, details: dict[str, Any]) -> Reward:
    details = {**details, "method": method}
    if correct:
        return Reward(score=1.0, passed=True, details=details)
    return Reward(score=0.0, passed=False, failure=FailureClass.WRONG_ANSWER, details=details)
