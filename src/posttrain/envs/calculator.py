"""A safe arithmetic evaluator for the calculator tool: a recursive-descent parser, never `eval`.

Grammar (usual precedence, `**` right-associative and binding tighter than unary minus, as in Python):

    expr   := term (('+' | '-') term)*
    term   := unary (('*' | '/' | '//' | '%') unary)*
    unary  := ('+' | '-') unary | power
    power  := atom ('**' unary)?
    atom   := NUMBER | '(' expr ')'

Numbers are decimals (``12``, ``3.5``, ``1,234`` is *not* accepted: commas are ambiguous) and arithmetic is exact
(`fractions.Fraction`), so ``0.1+0.2`` is ``0.3``. Results that are not integers print as decimals rounded to 10
places. Input length, nesting depth, exponents and result sizes are bounded, so a model cannot make the tool hang
(``9**9**9`` is refused in microseconds).
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_EXPRESSION_CHARS = 500
MAX_DEPTH = 50
MAX_EXPONENT = 1000
MAX_RESULT_DIGITS = 400

_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(\*\*|//|[-+*/%()]))")


class CalculatorError(ValueError):
    """The expression is malformed or its value is out of bounds; the message is shown to the model."""


def calculate(expression: str) -> Fraction:
    """The exact value of `expression`; raises `CalculatorError` with a short reason."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    parser = _Parser(_tokenize(expression.replace("×", "*").replace("÷", "/")))
    value = parser.expr(0)
    if parser.position != len(parser.tokens):
        raise CalculatorError(f"unexpected '{parser.tokens[parser.position]}'")
    return value


def format_number(value: Fraction) -> str:
    """`12`, `-3.5`, `0.3333333333` (10 decimals, trailing zeros dropped)."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    scaled = round(abs(value) * 10**10)
    whole, frac = divmod(scaled, 10**10)
    digits = f"{frac:010d}".rstrip("0")
    return f"{sign}{whole}.{digits}" if digits else f"{sign}{whole}"


def evaluate(expression: str) -> str:
    """`calculate` then `format_number`: what the calculator tool returns."""
    return format_number(calculate(expression))


def _tokenize(text: str) -> list[str]:
    tokens, position = [], 0
    text = text.rstrip()
    while position < len(text):
        match = _TOKEN.match(text, position)
        if not match:
            raise CalculatorError(f"unexpected character {text[position:].lstrip()[:1]!r}")
        tokens.append(match.group(1) or match.group(2))
        position = match.end()
    if not tokens:
        raise CalculatorError("empty expression")
    return tokens


class _Parser:
    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.position = 0

    def _peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise CalculatorError("expression ends too early")
        self.position += 1
        return token

    def expr(self, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise CalculatorError("expression nested too deeply")
        value = self.term(depth)
        while self._peek() in ("+", "-"):
            value = value + self.term(depth) if self._take() == "+" else value - self.term(depth)
            _check_size(value)
        return value

    def term(self, depth: int) -> Fraction:
        value = self.unary(depth)
        while self._peek() in ("*", "/", "//", "%"):
            op, right = self._take(), self.unary(depth)
            if op != "*" and right == 0:
                raise CalculatorError("division by zero")
            if op == "*":
                value = value * right
            elif op == "/":
                value = value / right
            elif op == "//":
                value = Fraction(value // right)
            else:
                value = value - right * (value // right)
            _check_size(value)
        return value

    def unary(self, depth: int) -> Fraction:
        if self._peek() in ("+", "-"):
            sign = self._take()
            value = self.unary(depth + 1)
            return -value if sign == "-" else value
        return self.power(depth)

    def power(self, depth: int) -> Fraction:
        base = self.atom(depth)
        if self._peek() != "**":
            return base
        self._take()
        exponent = self.unary(depth + 1)
        if exponent.denominator != 1:
            raise CalculatorError("only integer exponents are supported")
        if abs(exponent) > MAX_EXPONENT:
            raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
        if base == 0 and exponent < 0:
            raise CalculatorError("division by zero")
        # Bound the size before computing: digits(base**e) ~ e * digits(base).
        digits = max(len(str(abs(base.numerator))), len(str(base.denominator)))
        if abs(int(exponent)) * digits > MAX_RESULT_DIGITS:
            raise CalculatorError(f"result would have more than {MAX_RESULT_DIGITS} digits")
        return base ** int(exponent)

    def atom(self, depth: int) -> Fraction:
        token = self._take()
        if token == "(":
            value = self.expr(depth + 1)
            if self._peek() != ")":
                raise CalculatorError("missing ')'")
            self._take()
            return value
        if token[0].isdigit() or token[0] == ".":
            return Fraction(token)
        raise CalculatorError(f"unexpected '{token}'")


def _check_size(value: Fraction) -> None:
    if value.numerator.bit_length() > MAX_RESULT_DIGITS * 4 or value.denominator.bit_length() > MAX_RESULT_DIGITS * 4:
        raise CalculatorError(f"result would have more than {MAX_RESULT_DIGITS} digits")
