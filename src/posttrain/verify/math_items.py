"""Math answers as lists of items: split a solution set, expand ``\\pm``, drop labels, units and separators.

Competition answers list solutions several ways: ``1, 2, 3``; ``a=4,-8,-10``; ``x = 2 \\text{ or } x = 3``;
``\\{1, 2\\}``; ``\\frac{-1 \\pm \\sqrt{5}}{2}``; ``(11,7) \\text{ or } (7,11)``. `answer_items` turns each into its
items: the top-level pieces between commas, semicolons and the words "or"/"and" (brackets protect: ``(1,2)``,
``[1,3)`` and ``\\begin{pmatrix}...`` are one item, so a pair or an interval keeps its order); an outer ``\\{...\\}``
is dropped; each item keeps its label (``x`` of ``x = 2``; one on the first item only, ``a=4,-8,-10``, labels
them all) so that the verifier can match ``x=1, y=2`` by name; an item with one ``\\pm``/``\\mp`` is two items.

`tidy` makes one item comparable without changing its mathematics: thousands separators (``11,\\!111``,
``10{,}000``, ``12\\,000``, or ``1,234,567`` when that is the whole item), ``\\$``, a unit after a number
(``12 \\text{ cm}^2``, ``7 apples``, ``120 \\text{ degrees}``) and ``percent`` (as ``\\%``) go. It keeps spaces and
LaTeX, so its output can still be parsed by math-verify. Text answers (``\\text{Evelyn}``, ``(C)``, ``yes``) are
compared as text by `text_answer` - math-verify would read ``Yes`` as the product of three letters, equal to ``Sey``.
"""

from __future__ import annotations

import re

from posttrain.verify.math_rational import MAX_CHARS, NOT_UNITS

_SEPARATOR_WORD = re.compile(r"\\(?:text|textrm|mbox|mathrm)\s*\{\s*(or|and)\s*\}")
_BRACKET_COMMAND = re.compile(r"\\(?:begin|left)\b|\\(?:end|right)\b|\\[{}]")
_SEPARATOR = re.compile(r"(?<![\\A-Za-z])(?:or|and)(?![A-Za-z])")
PLUS_MINUS = re.compile(r"\\(?:pm|mp)(?![A-Za-z])")
_LABEL = re.compile(r"^\s*([A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?)\s*(?:=(?!=)|\\in\b)\s*")
_THOUSANDS_MARKED = re.compile(r"(?<![\d.])(\d{1,3})((?:(?:,\\!|\{,\}|\\,|,)\d{3})+)(?![\d])")
_THOUSANDS_PLAIN = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")
_PERCENT_WORD = re.compile(r"\s*(?:\\(?:text|textrm|mbox|mathrm)\s*\{\s*per\s?cent\s*\}|per\s?cent)\s*$", re.IGNORECASE)
# units: after something numeric, a \text{...} of letters or up to three bare words, maybe squared/cubed
_UNIT = re.compile(r"\s*(?:\\(?:text|textrm|mbox|mathrm)\s*\{\s*([A-Za-z][A-Za-z./ ]*?)\s*\}|"
                   r"(?<=[\s~])([A-Za-z]{2,}(?:\s+[A-Za-z]+){0,2}))\s*(?:\^\{?[23]\}?)?\s*$")
# a bare unit word is spaced off its number and is a known short unit or a word of 3+ letters ("5ab" is a product)
_SHORT_UNITS = frozenset({"cm", "mm", "km", "ft", "in", "yd", "mi", "kg", "mg", "lb", "oz", "hr", "ml", "cc",
                          "am", "pm"})
_NUMERIC_END = re.compile(r"(?:\d|\\pi|\}|\))(?:\s|\\[,;:! ]|~)*$")
_TEXT_WRAPPER = re.compile(r"^\\(?:text|textbf|textrm|mathrm|mathbf|mbox|textit)\s*\{(.*)\}$", re.DOTALL)
_WORDS = re.compile(r"[A-Za-z]{3,}(?: [A-Za-z]{2,})*")
_CHOICE = re.compile(r"\(?([A-Ea-e])\)?")


def tidy(item: str) -> str:
    """`item` without thousands separators, ``\\$``, ``\\!``, a trailing unit or ``percent`` (see the module doc)."""
    s = item.strip().strip("$").strip()
    if len(s) > MAX_CHARS:  # no competition answer is this long; the unit patterns below are not linear
        return s
    s = _THOUSANDS_MARKED.sub(_join_thousands, s) if ("\\!" in s or "{,}" in s or "\\," in s) else s
    if _THOUSANDS_PLAIN.fullmatch(s):
        s = s.replace(",", "")
    s = s.replace("\\$", "").replace("\\!", "").strip()
    s = _PERCENT_WORD.sub("\\%", s)
    for _ in range(2):
        s = _strip_unit(s)
    return s.strip()


def _join_thousands(match: re.Match) -> str:
    return match.group(1) + re.sub(r"[^\d]", "", match.group(2))


def _strip_unit(s: str) -> str:
    match = _UNIT.search(s)
    if match is None or match.start() == 0:
        return s
    words = (match.group(1) or match.group(2) or "").lower().replace(".", " ").replace("/", " ").split()
    rest = s[:match.start()]
    if not words or any(word in NOT_UNITS for word in words) or not _NUMERIC_END.search(rest):
        return s
    if match.group(2) and len(words[0]) < 3 and words[0] not in _SHORT_UNITS:
        return s
    return rest.rstrip()


def split_items(text: str) -> list[str]:
    """The top-level items of `text`: split at commas, semicolons, "or" and "and" outside brackets."""
    s = _SEPARATOR_WORD.sub(r" \1 ", text.strip())
    s = _unwrap_set(s)
    if not ("\\!" in s or "{,}" in s) and _THOUSANDS_PLAIN.fullmatch(s.strip()):
        return [s.strip()]
    s = _THOUSANDS_MARKED.sub(_join_thousands, s) if ("\\!" in s or "{,}" in s) else s
    items, depth, start, index = [], 0, 0, 0
    while index < len(s):
        char = s[index]
        if char == "\\":
            word = _BRACKET_COMMAND.match(s, index)
            if word:
                token = word.group(0)
                depth = depth + 1 if token in ("\\begin", "\\left", "\\{") else max(depth - 1, 0)
                index += len(token) + (1 if token in ("\\left", "\\right") else 0)  # \left( is one opening
                continue
            index += 2
            continue
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(depth - 1, 0)  # a stray closing bracket must not hide the commas after it
        elif depth == 0 and char in ",;":
            items.append(s[start:index])
            start = index + 1
        elif depth == 0 and (separator := _SEPARATOR.match(s, index)):
            items.append(s[start:index])
            start = index = separator.end()
            continue
        index += 1
    items.append(s[start:])
    if depth != 0:  # an unclosed bracket would hide every comma after it: count them all
        items = re.split(r"[,;]", s)
    return [item.strip() for item in items]


def _unwrap_set(s: str) -> str:
    """``\\{1, 2\\}`` (or ``x \\in \\{1, 2\\}``) -> ``1, 2`` when the braces enclose the whole text."""
    inner = _LABEL.sub("", s, count=1) if re.match(r"^\s*[A-Za-z]\s*\\in\b", s) else s
    inner = inner.strip()
    if inner.startswith("\\{") and inner.endswith("\\}") and "\\{" not in inner[2:-2] and "\\}" not in inner[2:-2]:
        return inner[2:-2]
    return s


def answer_items(text: str) -> list[tuple[str | None, str]]:
    """The (label, value) items of a possibly multi-solution answer, ``\\pm`` expanded (see the module doc).

    A label on the first item only (``a=4,-8,-10``) labels them all."""
    items = [item for item in split_items(text) if item != "" or text.strip() == ""]
    labels = [label_of(item) for item in items]
    if labels and labels[0] is not None and all(label is None for label in labels[1:]):
        labels = [labels[0]] * len(labels)
    expanded: list[tuple[str | None, str]] = []
    for label, item in zip(labels, items):
        expanded.extend((label, value) for value in expand_pm(_LABEL.sub("", item, count=1)))
    return expanded


def label_of(item: str) -> str | None:
    """``x`` for ``x = 3`` or ``x \\in [1, 2]``; None for an unlabelled item."""
    match = _LABEL.match(item)
    return match.group(1).replace("{", "").replace("}", "") if match else None


def expand_pm(item: str) -> list[str]:
    """``a \\pm b`` -> [``a + b``, ``a - b``]; an item with no or several ``\\pm``/``\\mp`` is left as it is."""
    signs = PLUS_MINUS.findall(item)
    if len(signs) != 1:
        return [item]
    plus, minus = ("+", "-") if signs[0] == "\\pm" else ("-", "+")
    return [PLUS_MINUS.sub(plus, item).strip(), PLUS_MINUS.sub(minus, item).strip()]


def text_answer(item: str) -> str | None:
    """The lower-cased words of a text answer (``\\text{Evelyn}``, ``Yes``, ``(C)``); None for mathematics."""
    s = item.strip().strip("$").strip().rstrip(".")
    for _ in range(2):
        wrapped = _TEXT_WRAPPER.match(s)
        if wrapped:
            s = wrapped.group(1).strip().rstrip(".")
    choice = _CHOICE.fullmatch(s)
    if choice and (s.startswith("(") or s.isupper()):
        return f"({choice.group(1).lower()})"
    s = re.sub(r"\s+", " ", s)
    return s.lower() if _WORDS.fullmatch(s) else None
