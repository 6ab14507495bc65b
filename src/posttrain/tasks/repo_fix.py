"""Repository fix, agentic: a small multi-file Python project with a bug and a failing test; fix it with tools.

The agent gets ``list_files``, ``read_file``, ``write_file`` and ``run_tests`` (the project's ``test_*.py``
files run in the sandbox) in the ``tools`` env. The reward is judged on the *final workspace*, not on anything the
agent says: the ``repo_tests`` verifier runs hidden function cases against every public function of the project
(through the ``code`` verifier: only the inputs enter the sandbox, outputs are compared outside), so editing
or deleting the visible tests, or printing "all passed", earns nothing. Score 1 only if every case passes.
Each step costs ``env_args["step_cost"]`` (recorded as the reward's ``step_cost`` component).

Projects come from three families (a shop checkout, text utilities, statistics helpers) with random constants;
a bug is a hand-written mutation of one line. Levels:
1. one bug; the visible tests test every function, so the failing test names the broken one;
2. one bug in a helper module; the visible tests only test the top-level function that uses it;
3. two bugs in different modules; every function tested.
The demonstration is the whole tool-using conversation: list the files, read the test file and the broken
module(s), write the fixed module(s), run the tests (all pass), then state what was fixed.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from string import Template
from typing import Any, Callable

from posttrain.data import SFTSample
from posttrain.envs import tool_schemas
from posttrain.tasks.base import TaskError, demo_conversation, domain, task_id, tool_call_message, tool_result_message
from posttrain.types import Task

TOOLS = ["list_files", "read_file", "write_file", "run_tests"]
TEST_FILE = "tests/test_project.py"


@dataclass(frozen=True)
class _Bug:
    path: str
    function: str
    correct: str  # the exact line of the template it replaces
    buggy: str


@dataclass(frozen=True)
class _Function:
    path: str
    name: str
    reference: Callable[[dict[str, Any]], Callable[..., Any]]
    inputs: Callable[[random.Random, dict[str, Any]], list[list[Any]]]  # hidden cases: argument lists
    top_level: bool = False  # tested at level 2 (the helpers it calls are not)
    helper: bool = False  # called by the top-level function: a level-2 bug goes here


@dataclass(frozen=True)
class _Family:
    name: str
    params: Callable[[random.Random], dict[str, Any]]
    files: dict[str, str]  # path -> string.Template source
    functions: list[_Function]
    bugs: list[_Bug]
    visible: Callable[[dict[str, Any]], list[tuple[str, list[Any]]]] = field(default=lambda p: [])


# --------------------------------------------------------------------------------------------------
# Family 1: a shop checkout
# --------------------------------------------------------------------------------------------------

_SHOP_FILES = {
    "shop/__init__.py": "",
    "shop/pricing.py": '''def subtotal(items):
    """Sum of price * quantity over (price, quantity) pairs; prices in cents."""
    total = 0
    for price, quantity in items:
        total += price * quantity
    return total


def discount(amount):
    """${percent}% off amounts of at least ${threshold} cents, rounded down to a whole cent."""
    if amount >= ${threshold}:
        return amount - amount * ${percent} // 100
    return amount
''',
    "shop/tax.py": '''def with_tax(amount):
    """The amount plus ${rate}% tax, rounded down to a whole cent."""
    return amount + amount * ${rate} // 100
''',
    "shop/checkout.py": '''from shop.pricing import discount, subtotal
from shop.tax import with_tax


def checkout_total(items):
    """What the customer pays: the subtotal, then the discount, then tax."""
    return with_tax(discount(subtotal(items)))
''',
}


def _shop_subtotal(p):
    return lambda items: sum(price * quantity for price, quantity in items)


def _shop_discount(p):
    return lambda amount: amount - amount * p["percent"] // 100 if amount >= p["threshold"] else amount


def _shop_tax(p):
    return lambda amount: amount + amount * p["rate"] // 100


def _shop_total(p):
    return lambda items: _shop_tax(p)(_shop_discount(p)(_shop_subtotal(p)(items)))


def _items(rng: random.Random) -> list[list[int]]:
    return [[rng.randint(1, 400), rng.randint(1, 4)] for _ in range(rng.randint(1, 4))]


_SHOP = _Family(
    name="shop",
    params=lambda rng: {"threshold": rng.randrange(300, 2000, 50), "percent": rng.randint(5, 30),
                        "rate": rng.randint(5, 25)},
    files=_SHOP_FILES,
    functions=[
        _Function("shop/pricing.py", "subtotal", _shop_subtotal, lambda rng, p: [[_items(rng)] for _ in range(4)],
                  helper=True),
        _Function("shop/pricing.py", "discount", _shop_discount,
                  lambda rng, p: [[p["threshold"]], [p["threshold"] - 1], [p["threshold"] * 3 + 7],
                                  [rng.randint(0, 3000)]], helper=True),
        _Function("shop/tax.py", "with_tax", _shop_tax, lambda rng, p: [[rng.randint(0, 5000)] for _ in range(3)],
                  helper=True),
        _Function("shop/checkout.py", "checkout_total", _shop_total,
                  lambda rng, p: [[_items(rng)] for _ in range(3)] + [[[[p["threshold"], 1]]], [[[700, 3], [5, 2]]]],
                  top_level=True),
    ],
    bugs=[
        _Bug("shop/pricing.py", "subtotal", "        total += price * quantity", "        total += price + quantity"),
        _Bug("shop/pricing.py", "discount", "    if amount >= ${threshold}:", "    if amount > ${threshold}:"),
        _Bug("shop/tax.py", "with_tax", "    return amount + amount * ${rate} // 100",
             "    return amount * ${rate} // 100"),
        _Bug("shop/checkout.py", "checkout_total", "    return with_tax(discount(subtotal(items)))",
             "    return with_tax(subtotal(items))"),
    ],
    visible=lambda p: [
        ("subtotal", [[[250, 2], [100, 1]]]),
        ("discount", [p["threshold"]]),
        ("discount", [p["threshold"] - 1]),
        ("with_tax", [1000]),
        ("checkout_total", [[[p["threshold"], 1]]]),
        ("checkout_total", [[[p["threshold"] * 2 + 3, 2], [40, 3]]]),
    ],
)

# --------------------------------------------------------------------------------------------------
# Family 2: text utilities
# --------------------------------------------------------------------------------------------------

_TEXT_FILES = {
    "text/__init__.py": "",
    "text/words.py": '''def words(text):
    """The words of `text`: maximal runs of letters or digits, lower-cased."""
    out, current = [], ""
    for ch in text:
        if ch.isalnum():
            current += ch.lower()
        elif current:
            out.append(current)
            current = ""
    if current:
        out.append(current)
    return out
''',
    "text/shorten.py": '''def shorten(text):
    """`text` if it has at most ${limit} characters, else its first ${keep} characters followed by '${mark}'."""
    if len(text) <= ${limit}:
        return text
    return text[:${keep}] + "${mark}"
''',
    "text/slug.py": '''from text.shorten import shorten
from text.words import words


def slugify(title):
    """The title's words joined by '${sep}', shortened to at most ${limit} characters."""
    return shorten("${sep}".join(words(title)))
''',
}

_TITLE_WORDS = ["Hello", "World", "the", "Quick", "brown", "FOX", "jumps", "over", "3", "lazy", "dogs", "2024",
                "data", "Report", "v2", "alpha"]


def _title(rng: random.Random) -> str:
    parts = rng.sample(_TITLE_WORDS, rng.randint(1, 5))
    return rng.choice(["", " "]) + rng.choice([" ", ", ", " - ", "! "]).join(parts) + rng.choice(["", "!", " ", "?"])


def _text_words(p):
    # An independent implementation of the template's loop (titles are ASCII: [^\W_] is "alphanumeric").
    return lambda text: re.findall(r"[^\W_]+", text.lower())


def _text_shorten(p):
    return lambda text: text if len(text) <= p["limit"] else text[: p["keep"]] + p["mark"]


def _text_slug(p):
    return lambda title: _text_shorten(p)(p["sep"].join(_text_words(p)(title)))


def _text_params(rng: random.Random) -> dict[str, Any]:
    limit, mark = rng.randint(10, 24), rng.choice(["...", "~", "+"])
    return {"limit": limit, "mark": mark, "keep": limit - len(mark), "sep": rng.choice(["-", "_", "."])}


_TEXT = _Family(
    name="text",
    params=_text_params,
    files=_TEXT_FILES,
    functions=[
        _Function("text/words.py", "words", _text_words, lambda rng, p: [[_title(rng)] for _ in range(5)],
                  helper=True),
        _Function("text/shorten.py", "shorten", _text_shorten,
                  lambda rng, p: [["x" * p["limit"]], ["y" * (p["limit"] + 1)], ["ab"], [_title(rng) * 3]],
                  helper=True),
        _Function("text/slug.py", "slugify", _text_slug, lambda rng, p: [[_title(rng)] for _ in range(5)],
                  top_level=True),
    ],
    bugs=[
        _Bug("text/words.py", "words", "            current += ch.lower()", "            current += ch"),
        _Bug("text/words.py", "words", "    if current:", "    if not current:"),
        _Bug("text/shorten.py", "shorten", "    if len(text) <= ${limit}:", "    if len(text) < ${limit}:"),
        _Bug("text/shorten.py", "shorten", '    return text[:${keep}] + "${mark}"',
             '    return text[:${limit}] + "${mark}"'),
    ],
    visible=lambda p: [
        ("words", ["Hello, World!"]),
        ("words", ["the Quick fox"]),
        ("shorten", ["z" * p["limit"]]),
        ("shorten", ["w" * (p["limit"] + 5)]),
        ("slugify", ["Hello, World"]),
        ("slugify", ["The quick brown fox jumps over"]),
        ("slugify", ["a" * p["limit"]]),
    ],
)

# --------------------------------------------------------------------------------------------------
# Family 3: statistics helpers
# --------------------------------------------------------------------------------------------------

_STATS_FILES = {
    "stats/__init__.py": "",
    "stats/basic.py": '''def mean(values):
    """The arithmetic mean of a non-empty list, as a float."""
    return sum(values) / len(values)


def median(values):
    """The median of a non-empty list, as a float (the mean of the two middle values for an even count)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[middle])
    return (ordered[middle - 1] + ordered[middle]) / 2
''',
    "stats/clean.py": '''def clamp(values):
    """Each value limited to the range [${low}, ${high}]."""
    return [min(max(v, ${low}), ${high}) for v in values]
''',
    "stats/smooth.py": '''from stats.basic import mean
from stats.clean import clamp


def moving_average(values):
    """The means of every window of ${window} consecutive values, after clamping them to [${low}, ${high}]."""
    values = clamp(values)
    return [mean(values[i:i + ${window}]) for i in range(len(values) - ${window} + 1)]
''',
}


def _stats_mean(p):
    return lambda values: sum(values) / len(values)


def _stats_median(p):
    def median(values):
        ordered, middle = sorted(values), len(values) // 2
        return float(ordered[middle]) if len(values) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    return median


def _stats_clamp(p):
    return lambda values: [min(max(v, p["low"]), p["high"]) for v in values]


def _stats_smooth(p):
    def moving_average(values):
        values, w = _stats_clamp(p)(values), p["window"]
        return [sum(values[i:i + w]) / w for i in range(len(values) - w + 1)]

    return moving_average


def _numbers(rng: random.Random, low: int = -50, high: int = 150, shortest: int = 1) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(shortest, 8))]


_STATS = _Family(
    name="stats",
    params=lambda rng: {"window": rng.randint(2, 4), "low": rng.randint(-10, 10), "high": rng.randint(60, 120)},
    files=_STATS_FILES,
    functions=[
        _Function("stats/basic.py", "mean", _stats_mean, lambda rng, p: [[_numbers(rng)] for _ in range(4)],
                  helper=True),
        _Function("stats/basic.py", "median", _stats_median,
                  lambda rng, p: [[_numbers(rng)] for _ in range(4)] + [[[9, 1, 5, 3]], [[7, 2, 5]]]),
        _Function("stats/clean.py", "clamp", _stats_clamp, lambda rng, p: [[_numbers(rng)] for _ in range(4)],
                  helper=True),
        _Function("stats/smooth.py", "moving_average", _stats_smooth,
                  lambda rng, p: [[_numbers(rng, shortest=p["window"])] for _ in range(5)], top_level=True),
    ],
    bugs=[
        _Bug("stats/basic.py", "mean", "    return sum(values) / len(values)", "    return sum(values) // len(values)"),
        _Bug("stats/basic.py", "median", "    ordered = sorted(values)", "    ordered = list(values)"),
        _Bug("stats/clean.py", "clamp", "    return [min(max(v, ${low}), ${high}) for v in values]",
             "    return [max(min(v, ${low}), ${high}) for v in values]"),
        _Bug("stats/smooth.py", "moving_average",
             "    return [mean(values[i:i + ${window}]) for i in range(len(values) - ${window} + 1)]",
             "    return [mean(values[i:i + ${window}]) for i in range(len(values) - ${window})]"),
    ],
    visible=lambda p: [
        ("mean", [[1, 2, 4]]),
        ("median", [[5, 1, 3]]),
        ("median", [[4, 1, 3, 2]]),
        ("clamp", [[p["low"] - 5, 30, p["high"] + 5]]),
        ("moving_average", [[1, 2, 4, 7, 11, 16, 22]]),
        ("moving_average", [[p["low"] - 20, 50, p["high"] + 40, 40, 33]]),
    ],
)

FAMILIES = {family.name: family for family in (_SHOP, _TEXT, _STATS)}


# --------------------------------------------------------------------------------------------------
# The domain
# --------------------------------------------------------------------------------------------------


@domain("repo_fix")
class RepoFix:
    name = "repo_fix"
    max_level = 3

    def __init__(self, families: list[str] | None = None, step_cost: float = 0.02, show_tool_schemas: bool = True,
                 system_prompt: str | None = None):
        unknown = set(families or []) - set(FAMILIES)
        if unknown:
            raise TaskError(f"repo_fix: unknown families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
        self.families = [FAMILIES[name] for name in (families or FAMILIES)]
        self.step_cost = step_cost
        self.show_tool_schemas = show_tool_schemas
        self.system_prompt = system_prompt

    def make_task(self, rng: random.Random, level: int) -> Task:
        family = rng.choice(self.families)
        params = family.params(rng)
        bugs = self._pick_bugs(rng, family, level)
        correct = {path: Template(source).substitute(params) for path, source in family.files.items()}
        broken = dict(correct)
        for bug in bugs:
            line, bad = Template(bug.correct).substitute(params), Template(bug.buggy).substitute(params)
            if broken[bug.path].count(line) != 1:
                raise TaskError(f"repo_fix: bug template for {bug.function} does not match {bug.path}")
            broken[bug.path] = broken[bug.path].replace(line, bad)
        top_only = level == 2
        tested = {f.name for f in family.functions if f.top_level or not top_only}
        broken[TEST_FILE] = correct[TEST_FILE] = _test_file(family, params, tested)
        checks = [_check(rng, family, function, params) for function in family.functions]
        prompt = (f"The tests of this project fail ({TEST_FILE}). Find and fix the bug"
                  f"{'s' if len(bugs) > 1 else ''} in the project's code (not in the tests), then reply with a "
                  "short summary of the fix.")
        messages = [{"role": "user", "content": prompt}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        key = f"{family.name}:{json.dumps(params, sort_keys=True)}:{sorted(b.buggy for b in bugs)}:{level}"
        locations = sorted([bug.path, bug.function] for bug in bugs)
        return Task(
            id=task_id(self.name, key),
            domain=self.name,
            difficulty=level,
            messages=messages,
            verifier="repo_tests",
            verifier_args={"checks": checks},
            env="tools",
            env_args={"files": broken, "step_cost": self.step_cost, "tool_schemas_in_prompt": self.show_tool_schemas},
            tools=list(TOOLS),
            max_steps={1: 12, 2: 14, 3: 18}[level],
            timeout_s=300.0,
            metadata={"problem_key": key, "family": family.name, "bugs": locations,
                      "bug_ids": sorted(family.bugs.index(bug) for bug in bugs),
                      "fixed_files": {path: correct[path] for path, _ in locations}, "test_file": TEST_FILE},
        )

    def demonstration(self, task: Task) -> SFTSample:
        files: dict[str, str] = task.env_args["files"]
        fixed: dict[str, str] = task.metadata["fixed_files"]
        turns: list[dict[str, Any]] = []

        def call(name: str, arguments: dict[str, Any], result: str) -> None:
            turns.extend([tool_call_message(name, arguments), tool_result_message(name, result)])

        call("list_files", {}, "\n".join(sorted(files)))
        call("read_file", {"path": TEST_FILE}, files[TEST_FILE])
        for path, content in fixed.items():
            call("read_file", {"path": path}, files[path])
            call("write_file", {"path": path, "content": content}, f"wrote {len(content.encode())} bytes to {path}")
        call("run_tests", {}, passing_report(files[TEST_FILE]))
        summary = "Fixed " + " and ".join(f"`{name}` in {path}" for path, name in task.metadata["bugs"])
        summary += "; the tests pass now."
        turns.append({"role": "assistant", "content": summary})
        trace = "Read the failing test, find the function whose behaviour disagrees with its docstring, fix that line."
        tools = tool_schemas(task.tools) if task.env_args.get("tool_schemas_in_prompt") else None
        return demo_conversation(task, turns, trace=trace, tools=tools)

    @staticmethod
    def _pick_bugs(rng: random.Random, family: _Family, level: int) -> list[_Bug]:
        if level == 1:
            return [rng.choice(family.bugs)]
        if level == 2:
            helpers = {f.name for f in family.functions if f.helper}
            return [rng.choice([b for b in family.bugs if b.function in helpers])]
        first = rng.choice(family.bugs)
        return [first, rng.choice([b for b in family.bugs if b.path != first.path])]


def _test_file(family: _Family, params: dict[str, Any], tested: set[str]) -> str:
    modules: dict[str, list[str]] = {}
    for function in family.functions:
        if function.name in tested:
            modules.setdefault(function.path[:-3].replace("/", "."), []).append(function.name)
    lines = [f"from {module} import {', '.join(sorted(names))}" for module, names in sorted(modules.items())]
    references = {f.name: f.reference(params) for f in family.functions}
    counts: dict[str, int] = {}
    for name, args in family.visible(params):
        if name not in tested:
            continue
        counts[name] = counts.get(name, 0) + 1
        expected = references[name](*json.loads(json.dumps(args)))
        call = f"{name}({', '.join(repr(a) for a in args)})"
        lines += ["", "", f"def test_{name}_{counts[name]}():", f"    assert {call} == {expected!r}"]
    return "\n".join(lines) + "\n"


def passing_report(test_source: str) -> str:
    """What `run_tests` prints when every test of `test_source` passes (its functions, sorted by name)."""
    names = sorted(line[4:].split("(")[0] for line in test_source.splitlines() if line.startswith("def test_"))
    lines = [f"PASSED {TEST_FILE}::{name}" for name in names]
    return "\n".join(lines + [f"{len(names)} passed, 0 failed"])


def _check(rng: random.Random, family: _Family, function: _Function, params: dict[str, Any]) -> dict[str, Any]:
    reference = function.reference(params)
    cases = []
    for args in function.inputs(rng, params):
        expected = reference(*json.loads(json.dumps(args)))
        cases.append({"args": args, "expected": expected})
    return {"file": function.path, "function": function.name, "cases": cases}
