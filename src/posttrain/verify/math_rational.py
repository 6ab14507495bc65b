"""Exact rational arithmetic for final answers: ``\\frac{1}{2^{99}}`` is 1/633825300114114700748351602688, exactly.

math-verify compares numbers after rounding to 6 significant digits, which accepts 1/2^99 for 1/2^98. When a
reference answer is a rational number we compare with `fractions.Fraction` instead. `parse_rational` understands
a small LaTeX/plain subset - integers, decimals, ``+ - * / ^``, ``\\cdot \\times \\div``, ``\\frac``/``\\dfrac``,
parentheses and braces, a leading ``x =``, thousands separators, a trailing ``%`` or unit in ``\\text{}`` - and
returns None for anything else (so the caller falls back to math-verify). Powers are bounded (`MAX_BITS`), so a
power tower is refused in microseconds instead of computed.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_BITS = 1 << 16  # largest numerator/denominator a power may produce
MAX_CHARS = 400

_STRIP = re.compile(r"\\left|\\right|\\displaystyle|\\[,;:! ]|~|\$|\\\(|\\\)|\\\[|\\\]|\s+")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")
_TRAILING_UNIT = re.compile(r"(\\(text|mathrm|textbf|mbox)\{\s*([A-Za-z. ]*)\}|\^\{?\\circ\}?|°|\\%|%)$")
_TEXT_GROUP = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}")
# words that are never a unit: "4 \text{ and more}", "3 \text{ at most}" are not 4 and 3
NOT_UNITS = frozenset({
    "or", "and", "to", "not", "no", "nor", "than", "more", "less", "least", "most", "at", "maybe", "either",
    "neither", "between", "except", "about", "around", "nearly", "roughly", "over", "under", "up", "plus", "minus",
    "above", "below", "if", "only", "so", "pi", "i", "e", "infty", "approx", "sqrt", "frac", "cdot", "ge", "le",
    "geq", "leq", "none", "all", "any", "every", "each", "some"})
_LEADING_VAR = re.compile(r"^[A-Za-z]\w*=(?!=)")
_TOKEN = re.compile(r"\d+\.\d*|\.\d+|\d+|\\[A-Za-z]+|\*\*|[-+*/^(){}\[\]]")


class _Refused(Exception):
    pass


def normalize(text: str) -> str:
    # a \text{...} holding a word that is never a unit is not stripped (the words run together below)
    words = {w.lower() for group in _TEXT_GROUP.findall(text) for w in re.findall(r"[A-Za-z]+", group)}
    strip_unit = _drop_unit if not words & NOT_UNITS else _symbol_unit
    s = _STRIP.sub("", text.strip())
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for _ in range(3):
        s = _TRAILING_UNIT.sub(strip_unit, s)
    s = _LEADING_VAR.sub("", s, count=1)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s.rstrip(".")


def _drop_unit(match: re.Match) -> str:
    return ""


def _symbol_unit(match: re.Match) -> str:
    return match.group(0) if match.group(2) else ""  # %, degrees go; a \text{...} stays


def parse_rational(text: str) -> Fraction | None:
    """The exact value of `text` if it is a plain rational expression; None otherwise."""
    if not isinstance(text, str) or len(text) > MAX_CHARS:
        return None
    source = normalize(text)
    if not source:
        return None
    tokens = _TOKEN.findall(source)
    if "".join(tokens) != source:
        return None  # something we do not understand (a letter, \sqrt, a comma ...)
    parser = _Parser(tokens)
    try:
        value = parser.expression()
        if parser.peek() is not None:
            return None
        return value
    except (_Refused, ZeroDivisionError, IndexError, ValueError):
        return None


class _Parser:
    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.position = 0

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise _Refused(f"expected {expected!r}, got {token!r}")
        self.position += 1
        return token

    def expression(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            sign = self.take()
            right = self.term()
            value = value + right if sign == "+" else value - right
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/", "\\cdot", "\\times", "\\div"):
            operator = self.take()
            right = self.unary()
            value = value / right if operator in ("/", "\\div") else value * right
        return value

    def unary(self) -> Fraction:
        if self.peek() in ("+", "-"):
            sign = self.take()
            value = self.unary()
            return -value if sign == "-" else value
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() in ("^", "**"):
            self.take()
            exponent = self.unary()  # right-associative: 2^3^2 = 2^(3^2)
            return _bounded_power(base, exponent)
        return base

    def atom(self) -> Fraction:
        token = self.take()
        if token[0].isdigit() or token[0] == ".":
            return Fraction(token)
        if token in ("(", "{", "["):
            closing = {"(": ")", "{": "}", "[": "]"}[token]
            value = self.expression()
            self.take(closing)
            return value
        if token == "\\frac":
            return self._frac_part() / self._frac_part()
        raise _Refused(f"unexpected {token!r}")

    def _frac_part(self) -> Fraction:
        token = self.peek()
        if token == "{":
            return self.atom()
        if token is not None and token.isdigit():  # \frac12 shorthand: one digit per part
            self.take()
            if len(token) == 1:
                return Fraction(token)
            # "\frac123" is 1/23 in LaTeX: split the digit run
            self.tokens[self.position:self.position] = [token[1:]]
            return Fraction(token[0])
        raise _Refused("malformed \\frac")


def _bounded_power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise _Refused("non-integer exponent")
    power = exponent.numerator
    size = max(abs(base.numerator).bit_length(), base.denominator.bit_length(), 1)
    if base in (0, 1, -1):
        size = 1
    if abs(power) * size > MAX_BITS:
        raise _Refused("power too large to compute exactly")
    return base**power
