"""A tiny PEG grammar for format checks: rules of literals, regexes, groups, ``? * +`` and ordered choice.

    answer  ::= think? "Answer: " number
    think   ::= "<think>" /[^<]*/ "</think>" /\\s*/
    number  ::= /-?[0-9]+/

The first rule is the start rule and must match the *whole* text. Matching is packrat (memoized), so it is
linear in the text length for a fixed grammar, and a model cannot make it backtrack exponentially.
`Grammar(text)` raises `VerifyError` for a malformed grammar (unknown rule, unbalanced group, bad regex).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from posttrain.verify.errors import VerifyError

_TOKEN = re.compile(r'\s*(?:(?P<lit>"(?:[^"\\]|\\.)*")|(?P<re>/(?:[^/\\]|\\.)+/)|(?P<name>[A-Za-z_][\w-]*)'
                    r"|(?P<op>[|()?*+]))")


@dataclass(frozen=True)
class _Lit:
    text: str


@dataclass(frozen=True)
class _Re:
    pattern: re.Pattern


@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Seq:
    items: tuple


@dataclass(frozen=True)
class _Choice:
    options: tuple


@dataclass(frozen=True)
class _Repeat:
    item: object
    low: int
    high: int | None


_Node = Union[_Lit, _Re, _Ref, _Seq, _Choice, _Repeat]


class Grammar:
    def __init__(self, text: str):
        self.rules: dict[str, _Node] = {}
        self.start = ""
        for number, line in enumerate(text.strip().splitlines(), 1):
            if not line.strip() or line.strip().startswith("#"):
                continue
            name, sep, body = line.partition("::=")
            name = name.strip()
            if not sep or not name.isidentifier():
                raise VerifyError(f"grammar line {number}: expected `name ::= expression`, got {line.strip()!r}")
            self.rules[name] = self._parse(body, number)
            self.start = self.start or name
        if not self.rules:
            raise VerifyError("grammar: no rules")
        for name, node in self.rules.items():
            self._check_refs(node, name)

    def _parse(self, body: str, line: int) -> _Node:
        tokens, position = [], 0
        while body[position:].strip():
            match = _TOKEN.match(body, position)
            if not match:
                raise VerifyError(f"grammar line {line}: cannot read {body[position:].strip()!r}")
            tokens.append((match.lastgroup, match.group(match.lastgroup)))
            position = match.end()
        node, used = self._choice(tokens, 0, line)
        if used != len(tokens):
            raise VerifyError(f"grammar line {line}: unexpected {tokens[used][1]!r}")
        return node

    def _choice(self, tokens: list, i: int, line: int) -> tuple[_Node, int]:
        options = []
        node, i = self._sequence(tokens, i, line)
        options.append(node)
        while i < len(tokens) and tokens[i] == ("op", "|"):
            node, i = self._sequence(tokens, i + 1, line)
            options.append(node)
        return (options[0] if len(options) == 1 else _Choice(tuple(options))), i

    def _sequence(self, tokens: list, i: int, line: int) -> tuple[_Node, int]:
        items = []
        while i < len(tokens) and tokens[i] not in (("op", "|"), ("op", ")")):
            kind, value = tokens[i]
            if kind == "lit":
                item: _Node = _Lit(value[1:-1].encode().decode("unicode_escape"))
                i += 1
            elif kind == "re":
                try:
                    item = _Re(re.compile(value[1:-1]))
                except re.error as error:
                    raise VerifyError(f"grammar line {line}: bad regex {value}: {error}") from None
                i += 1
            elif kind == "name":
                item, i = _Ref(value), i + 1
            elif value == "(":
                item, i = self._choice(tokens, i + 1, line)
                if i >= len(tokens) or tokens[i] != ("op", ")"):
                    raise VerifyError(f"grammar line {line}: unbalanced '('")
                i += 1
            else:
                raise VerifyError(f"grammar line {line}: unexpected {value!r}")
            while i < len(tokens) and tokens[i][0] == "op" and tokens[i][1] in "?*+":
                low, high = {"?": (0, 1), "*": (0, None), "+": (1, None)}[tokens[i][1]]
                item, i = _Repeat(item, low, high), i + 1
            items.append(item)
        if not items:
            raise VerifyError(f"grammar line {line}: empty alternative")
        return (items[0] if len(items) == 1 else _Seq(tuple(items))), i

    def _check_refs(self, node: _Node, rule: str) -> None:
        if isinstance(node, _Ref) and node.name not in self.rules:
            raise VerifyError(f"grammar rule {rule!r} uses undefined rule {node.name!r}")
        for child in getattr(node, "items", ()) + getattr(node, "options", ()):
            self._check_refs(child, rule)
        if isinstance(node, _Repeat):
            self._check_refs(node.item, rule)

    def matches(self, text: str) -> bool:
        memo: dict[tuple[int, int], int | None] = {}

        def match(node: _Node, at: int) -> int | None:
            key = (id(node), at)
            if key in memo:
                return memo[key]
            memo[key] = None  # left recursion fails instead of looping
            if isinstance(node, _Lit):
                end = at + len(node.text) if text.startswith(node.text, at) else None
            elif isinstance(node, _Re):
                found = node.pattern.match(text, at)
                end = found.end() if found else None
            elif isinstance(node, _Ref):
                end = match(self.rules[node.name], at)
            elif isinstance(node, _Seq):
                end = at
                for item in node.items:
                    end = match(item, end)
                    if end is None:
                        break
            elif isinstance(node, _Choice):
                end = next((e for e in (match(o, at) for o in node.options) if e is not None), None)
            else:
                end, count = at, 0
                while node.high is None or count < node.high:
                    step = match(node.item, end)
                    if step is None or step == end:
                        break
                    end, count = step, count + 1
                if count < node.low:
                    end = None
            memo[key] = end
            return end

        return match(self.rules[self.start], 0) == len(text)
