"""Code: write a small Python function from a description; judged by unit cases in the sandbox.

Each problem comes from a family (add a constant, run-length encoding, balanced brackets ...) with random
parameters, so the description and the expected outputs change together. The prompt shows two example calls;
the ``code`` verifier runs those plus eight held-out cases (function cases: only the inputs enter the sandbox,
outputs come back as JSON and are compared outside), so hard-coding the examples scores at most 0.2.
Levels: 1 one-liners, 2 a loop with state, 3 small algorithms. The demonstration is a short plan (the reasoning
trace) and the reference solution in a ```python block.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable

from posttrain.data import SFTSample
from posttrain.tasks.base import TaskError, demo_sample, domain, task_id
from posttrain.types import Task

SHOWN_CASES = 2
HIDDEN_CASES = 8


@dataclass(frozen=True)
class _Family:
    name: str
    level: int
    params: Callable[[random.Random], dict[str, Any]]
    describe: Callable[[dict[str, Any]], str]
    source: Callable[[dict[str, Any]], str]
    inputs: Callable[[random.Random, dict[str, Any]], list]  # one call's positional arguments
    plan: str


def _ints(rng: random.Random, low: int = -20, high: int = 40, longest: int = 7) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(0, longest))]


def _word(rng: random.Random, letters: str = "abcdefghijklmnopqrstuvwxyz", longest: int = 8) -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(1, longest)))


_WORD_PAIRS = [["Fizz", "Buzz"], ["Ping", "Pong"], ["Tick", "Tock"], ["Foo", "Bar"], ["Hip", "Hop"]]
_BRACKETS = ["()", "[]", "{}", "<>"]

FAMILIES: list[_Family] = [
    _Family(
        "affine", 1,
        lambda rng: {"a": rng.randint(1, 5), "k": rng.randint(-20, 20)},
        lambda p: f"Write a Python function `affine(xs)` that returns a new list where every integer x of the "
                  f"list `xs` becomes x * {p['a']} + {p['k']}.",
        lambda p: f"def affine(xs):\n    return [x * {p['a']} + {p['k']} for x in xs]",
        lambda rng, p: [_ints(rng)],
        "Transform each element with a list comprehension.",
    ),
    _Family(
        "count_past", 1,
        lambda rng: {"t": rng.randint(-30, 60), "above": rng.random() < 0.5},
        lambda p: f"Write a Python function `count_past(xs)` that returns how many integers in the list `xs` "
                  f"are strictly {'greater' if p['above'] else 'less'} than {p['t']}.",
        lambda p: f"def count_past(xs):\n    return sum(1 for x in xs if x {'>' if p['above'] else '<'} {p['t']})",
        lambda rng, p: [_ints(rng, -40, 70, longest=9)],
        "Count the elements past the threshold with a generator.",
    ),
    _Family(
        "repeat_word", 1,
        lambda rng: {"k": rng.randint(2, 6), "sep": rng.choice(["-", "+", "_", " ", ",", ";", ":", "/"]),
                     "upper": rng.random() < 0.5},
        lambda p: f"Write a Python function `repeat_word(word)` that returns the string `word`"
                  f"{' in upper case' if p['upper'] else ''} repeated {p['k']} times, joined by {p['sep']!r}.",
        lambda p: f"def repeat_word(word):\n    return {p['sep']!r}.join([word{'.upper()' if p['upper'] else ''}] "
                  f"* {p['k']})",
        lambda rng, p: [_word(rng)],
        "Join k copies of the word with the separator.",
    ),
    _Family(
        "sum_multiples", 1,
        lambda rng: {"k": rng.randint(2, 30), "inclusive": rng.random() < 0.5},
        lambda p: f"Write a Python function `sum_multiples(n)` that returns the sum of all integers i with "
                  f"{'1 <= i <= n' if p['inclusive'] else '0 <= i < n'} that are divisible by {p['k']}.",
        lambda p: f"def sum_multiples(n):\n    return sum(i for i in range({'1, n + 1' if p['inclusive'] else 'n'})"
                  f" if i % {p['k']} == 0)",
        lambda rng, p: [rng.randint(0, 150)],
        "Sum the multiples of k in the range.",
    ),
    _Family(
        "clip_values", 1,
        lambda rng: (lambda lo: {"lo": lo, "hi": lo + rng.randint(3, 25)})(rng.randint(-20, 10)),
        lambda p: f"Write a Python function `clip_values(xs)` that returns a new list where every integer x of "
                  f"the list `xs` is clipped to the range {p['lo']} to {p['hi']}: values below {p['lo']} become "
                  f"{p['lo']} and values above {p['hi']} become {p['hi']}.",
        lambda p: f"def clip_values(xs):\n    return [min(max(x, {p['lo']}), {p['hi']}) for x in xs]",
        lambda rng, p: [_ints(rng, -30, 40)],
        "Clip each element with min and max in a list comprehension.",
    ),
    _Family(
        "count_between", 1,
        lambda rng: (lambda lo: {"lo": lo, "hi": lo + rng.randint(0, 25)})(rng.randint(-30, 30)),
        lambda p: f"Write a Python function `count_between(xs)` that returns how many integers in the list `xs` "
                  f"are between {p['lo']} and {p['hi']}, both included.",
        lambda p: f"def count_between(xs):\n    return sum(1 for x in xs if {p['lo']} <= x <= {p['hi']})",
        lambda rng, p: [_ints(rng, -30, 45, longest=9)],
        "Count the elements inside the range with a generator.",
    ),
    _Family(
        "power_mod", 1,
        lambda rng: {"p": rng.randint(2, 4), "m": rng.randint(3, 40)},
        lambda p: f"Write a Python function `power_mod(n)` that returns n to the power {p['p']}, modulo {p['m']} "
                  f"(Python's % operator).",
        lambda p: f"def power_mod(n):\n    return n ** {p['p']} % {p['m']}",
        lambda rng, p: [rng.randint(-20, 60)],
        "Raise n to the power, then take the remainder.",
    ),
    _Family(
        "fizz", 2,
        lambda rng: dict(zip(("a", "b"), rng.sample(range(2, 8), 2)), words=rng.choice(_WORD_PAIRS)),
        lambda p: f"Write a Python function `fizz(n)` that returns a list of strings for the numbers 1 to n: "
                  f"'{p['words'][0]}{p['words'][1]}' for multiples of both {p['a']} and {p['b']}, "
                  f"'{p['words'][0]}' for multiples of {p['a']} only, '{p['words'][1]}' for multiples of "
                  f"{p['b']} only, and the number itself as a string otherwise.",
        lambda p: (
            "def fizz(n):\n    out = []\n    for i in range(1, n + 1):\n"
            f"        if i % {p['a']} == 0 and i % {p['b']} == 0:\n"
            f"            out.append({p['words'][0] + p['words'][1]!r})\n"
            f"        elif i % {p['a']} == 0:\n            out.append({p['words'][0]!r})\n"
            f"        elif i % {p['b']} == 0:\n            out.append({p['words'][1]!r})\n"
            "        else:\n            out.append(str(i))\n    return out"
        ),
        lambda rng, p: [rng.randint(0, 30)],
        "Loop from 1 to n and test the combined multiple first, then each divisor.",
    ),
    _Family(
        "running_total", 2,
        lambda rng: {"m": rng.randint(5, 50), "start": rng.randint(0, 9)},
        lambda p: f"Write a Python function `running_total(xs)` that starts a total at {p['start']}, adds the "
                  f"integers of `xs` one by one, reduces the total modulo {p['m']} (Python's % operator) after "
                  "each addition, and returns the list of totals after each element.",
        lambda p: (
            f"def running_total(xs):\n    total = {p['start']}\n    out = []\n    for x in xs:\n"
            f"        total = (total + x) % {p['m']}\n        out.append(total)\n    return out"
        ),
        lambda rng, p: [_ints(rng, -60, 90, longest=8)],
        "Keep a running total, reduce it modulo m after each element and record it.",
    ),
    _Family(
        "shift_letters", 2,
        lambda rng: {"k": rng.randint(1, 25), "forward": rng.random() < 0.5},
        lambda p: f"Write a Python function `shift_letters(s)` that shifts every lowercase letter a-z of the "
                  f"string `s` {'forward' if p['forward'] else 'backward'} by {p['k']} places in the alphabet, "
                  "wrapping around, and leaves all other characters unchanged.",
        lambda p: (
            "def shift_letters(s):\n    out = []\n    for c in s:\n        if 'a' <= c <= 'z':\n"
            f"            out.append(chr((ord(c) - ord('a') {'+' if p['forward'] else '-'} {p['k']}) % 26 "
            "+ ord('a')))\n"
            "        else:\n            out.append(c)\n    return ''.join(out)"
        ),
        lambda rng, p: [_word(rng, "abcxyz mnoQRS!", longest=12)],
        "Map each lowercase letter through its alphabet index shifted by k modulo 26.",
    ),
    _Family(
        "count_chars", 2,
        lambda rng: {"chars": "".join(sorted(rng.sample("abcdefghijklmnopqrstuvwxyz", rng.randint(2, 5))))},
        lambda p: f"Write a Python function `count_chars(s)` that returns how many characters of the string `s` "
                  f"are one of the letters {p['chars']!r} (case-sensitive).",
        lambda p: f"def count_chars(s):\n    return sum(1 for c in s if c in {p['chars']!r})",
        lambda rng, p: [_word(rng, p["chars"] + "xyzAE ", longest=14)],
        "Count the characters that belong to the given set.",
    ),
    _Family(
        "rle", 3,
        lambda rng: {"count_first": rng.random() < 0.5, "sep": rng.choice(["", ",", ";", " "]),
                     "skip_ones": rng.random() < 0.5},
        lambda p: "Write a Python function `rle(s)` that run-length encodes the string `s`: each maximal run of "
                  "one repeated character becomes " + ("the run length followed by the character"
                                                        if p["count_first"] else
                                                        "the character followed by the run length")
                  + (" (a run of length 1 is just the character)" if p["skip_ones"] else "")
                  + f", and the pieces are joined by {p['sep']!r} (the empty string gives '').",
        lambda p: (
            "def rle(s):\n    out = []\n    i = 0\n    while i < len(s):\n        j = i\n"
            "        while j < len(s) and s[j] == s[i]:\n            j += 1\n"
            + ("        count = '' if j - i == 1 else str(j - i)\n" if p["skip_ones"] else
               "        count = str(j - i)\n")
            + ("        out.append(count + s[i])\n" if p["count_first"] else "        out.append(s[i] + count)\n")
            + f"        i = j\n    return {p['sep']!r}.join(out)"
        ),
        lambda rng, p: ["".join(rng.choice("aab") * rng.randint(1, 4) for _ in range(rng.randint(0, 5)))],
        "Walk the string, measure each run of equal characters and emit its encoding.",
    ),
    _Family(
        "balanced", 3,
        lambda rng: {"pairs": sorted(rng.sample(_BRACKETS, rng.randint(2, 3)))},
        lambda p: "Write a Python function `balanced(s)` that returns True if the brackets "
                  + ", ".join(repr(b) for b in p["pairs"])
                  + " in the string `s` are balanced and properly nested, and False otherwise; other characters "
                  "are ignored.",
        lambda p: (
            f"def balanced(s):\n    pairs = {{{', '.join(f'{b[1]!r}: {b[0]!r}' for b in p['pairs'])}}}\n"
            "    stack = []\n    for c in s:\n        if c in pairs.values():\n            stack.append(c)\n"
            "        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n"
            "                return False\n    return not stack"
        ),
        lambda rng, p: ["".join(rng.choice("".join(p["pairs"]) + "x") for _ in range(rng.randint(0, 8)))],
        "Push opening brackets on a stack and pop on each closing one, checking that they match.",
    ),
    _Family(
        "digital_root", 3,
        lambda rng: {"base": rng.randint(3, 16)},
        lambda p: f"Write a Python function `digital_root(n)` that, for a non-negative integer n, repeatedly "
                  f"replaces n by the sum of its digits in base {p['base']} until n is less than {p['base']}, "
                  "and returns n.",
        lambda p: (
            f"def digital_root(n):\n    while n >= {p['base']}:\n        total = 0\n        while n:\n"
            f"            total += n % {p['base']}\n            n //= {p['base']}\n        n = total\n    return n"
        ),
        lambda rng, p: [rng.randint(0, 10 ** rng.randint(1, 6))],
        "Sum the base-b digits with divmod until a single digit remains.",
    ),
    _Family(
        "to_base", 3,
        lambda rng: {"base": rng.randint(2, 16), "width": rng.randint(1, 6)},
        lambda p: f"Write a Python function `to_base(n)` that returns the non-negative integer n written in base "
                  f"{p['base']} with the digits '0123456789abcdef', left-padded with '0' to at least "
                  f"{p['width']} characters.",
        lambda p: (
            "def to_base(n):\n    digits = ''\n    while n:\n"
            f"        digits = '0123456789abcdef'[n % {p['base']}] + digits\n        n //= {p['base']}\n"
            f"    return digits.rjust({p['width']}, '0')"
        ),
        lambda rng, p: [rng.randint(0, 10 ** rng.randint(1, 5))],
        "Collect the base-b digits from least significant up, then pad on the left.",
    ),
    _Family(
        "window", 3,
        lambda rng: {"w": rng.randint(2, 6), "agg": rng.choice(["sum", "max", "min"])},
        lambda p: f"Write a Python function `window(xs)` that returns the list of the {p['agg']} of every window "
                  f"of {p['w']} consecutive integers of the list `xs`, in order (an empty list when `xs` has fewer "
                  f"than {p['w']} elements).",
        lambda p: f"def window(xs):\n    return [{p['agg']}(xs[i:i + {p['w']}]) "
                  f"for i in range(len(xs) - {p['w']} + 1)]",
        lambda rng, p: [_ints(rng, -30, 30, longest=10)],
        "Slide a window of width w over the list and aggregate each slice.",
    ),
    _Family(
        "merge_intervals", 3,
        lambda rng: {"touching": rng.random() < 0.5},
        lambda p: "Write a Python function `merge_intervals(intervals)` that takes a list of [start, end] integer "
                  "pairs (start <= end, in any order) and returns the merged list of [start, end] pairs sorted by "
                  "start, where an interval is merged into the previous one when its start is "
                  + ("at most" if p["touching"] else "strictly less than") + " the previous end.",
        lambda p: (
            "def merge_intervals(intervals):\n    out = []\n    for start, end in sorted(intervals):\n"
            f"        if out and start {'<=' if p['touching'] else '<'} out[-1][1]:\n"
            "            out[-1][1] = max(out[-1][1], end)\n"
            "        else:\n            out.append([start, end])\n    return out"
        ),
        lambda rng, p: [[sorted([rng.randint(0, 20), rng.randint(0, 20)]) for _ in range(rng.randint(0, 5))]],
        "Sort by start, then extend the last merged interval or start a new one.",
    ),
]


@domain("code")
class Code:
    name = "code"
    max_level = 3

    def __init__(self, families: list[str] | None = None, system_prompt: str | None = None):
        known = {f.name for f in FAMILIES}
        unknown = set(families or []) - known
        if unknown:
            raise TaskError(f"code: unknown families {sorted(unknown)}; known: {', '.join(sorted(known))}")
        self.families = [f for f in FAMILIES if not families or f.name in families]
        self.system_prompt = system_prompt

    def make_task(self, rng: random.Random, level: int) -> Task:
        candidates = [f for f in self.families if f.level == level] or self.families
        family = rng.choice(candidates)
        params = family.params(rng)
        source = family.source(params)
        function = _compile(source, family.name)
        cases = _cases(rng, family, params, function)
        shown = "\n".join(f"{family.name}({', '.join(map(repr, c['args']))}) == {c['expected']!r}"
                          for c in cases[:SHOWN_CASES])
        prompt = (f"{family.describe(params)}\nExamples:\n{shown}\n"
                  "Answer with the complete function in a ```python code block.")
        messages = [{"role": "user", "content": prompt}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        key = f"{family.name}:{json.dumps(params, sort_keys=True)}"
        return Task(
            id=task_id(self.name, key + prompt),
            domain=self.name,
            difficulty=family.level,
            messages=messages,
            verifier="code",
            verifier_args={"tests": {"function": family.name, "cases": cases}},
            max_steps=1,
            timeout_s=60.0,
            metadata={"problem_key": key, "family": family.name, "params": params, "solution": source,
                      "plan": family.plan},
        )

    def demonstration(self, task: Task) -> SFTSample:
        answer = f"```python\n{task.metadata['solution']}\n```"
        return demo_sample(task, answer, task.metadata["plan"])


def _compile(source: str, name: str) -> Callable[..., Any]:
    # Our own reference source (never model output), run here only to compute the expected outputs.
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<reference {name}>", "exec"), namespace)  # noqa: S102
    return namespace[name]


def _cases(rng: random.Random, family: _Family, params: dict[str, Any], function: Callable) -> list[dict]:
    cases, seen = [], set()
    for _ in range(200):
        args = family.inputs(rng, params)
        key = repr(args)
        if key in seen:
            continue
        seen.add(key)
        cases.append({"args": args, "expected": function(*[_copy(a) for a in args])})
        if len(cases) == SHOWN_CASES + HIDDEN_CASES:
            break
    return cases


def _copy(value: Any) -> Any:
    return [_copy(v) for v in value] if isinstance(value, list) else value
