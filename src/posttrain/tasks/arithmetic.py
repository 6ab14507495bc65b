"""Arithmetic: integer addition and subtraction, difficulty = number of digits; a tiny model can learn it.

Prompt: ``347+285``. Answer: ``632``. Reasoning trace (column by column, least significant first, with the
carry or borrow written out): ``7+5=12,4+8+1=13,3+2+1=6``; ``872-343`` gives ``12-3=9,7-4-1=2,8-3=5``. The trace makes each digit a local lookup,
which is what lets a 3M-parameter model reach ~100% on unseen 3-digit problems in minutes.

Levels 1..max_level are the operand digit counts; `operators` chooses among "+" and "-" (subtraction keeps
the result non-negative by ordering the operands).
"""

from __future__ import annotations

import random

from posttrain.data import SFTSample
from posttrain.tasks.base import TaskError, demo_sample, domain, task_id, user_messages
from posttrain.types import Task


@domain("arithmetic")
class Arithmetic:
    name = "arithmetic"

    def __init__(self, operators: str = "+", max_level: int = 6, system_prompt: str | None = None):
        if not operators or set(operators) - set("+-"):
            raise TaskError(f"arithmetic: operators must be a non-empty mix of '+' and '-', got {operators!r}")
        self.operators = operators
        self.max_level = max_level
        self.system_prompt = system_prompt

    def make_task(self, rng: random.Random, level: int) -> Task:
        low = 0 if level == 1 else 10 ** (level - 1)
        a, b = rng.randint(low, 10**level - 1), rng.randint(low, 10**level - 1)
        op = rng.choice(self.operators)
        if op == "-" and b > a:
            a, b = b, a
        problem = f"{a}{op}{b}"
        answer = str(a + b if op == "+" else a - b)
        return Task(
            id=task_id(self.name, problem),
            domain=self.name,
            difficulty=level,
            messages=user_messages(problem, self.system_prompt),
            verifier="exact",
            verifier_args={"answer": answer},
            max_steps=1,
            timeout_s=10.0,
            metadata={"problem_key": problem, "answer": answer, "a": a, "b": b, "op": op},
        )

    def demonstration(self, task: Task) -> SFTSample:
        meta = task.metadata
        trace = column_trace(meta["a"], meta["b"], meta["op"])
        return demo_sample(task, meta["answer"], trace)


def column_trace(a: int, b: int, op: str) -> str:
    """Digit-by-digit working, least significant column first: '7+5=12,4+8+1=13,3+2+1=6'."""
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    steps = []
    carry = 0
    for i in range(max(len(digits_a), len(digits_b))):
        x = int(digits_a[i]) if i < len(digits_a) else 0
        y = int(digits_b[i]) if i < len(digits_b) else 0
        if op == "+":
            total = x + y + carry
            steps.append(f"{x}+{y}{'+1' if carry else ''}={total}")
            carry = total // 10
        else:
            value = x - y - carry
            borrow = value < 0
            # A borrow is written as the borrowed column ("12-3=9"), so every step ends in a result digit.
            steps.append(f"{'1' if borrow else ''}{x}-{y}{'-1' if carry else ''}={value + 10 if borrow else value}")
            carry = 1 if borrow else 0
    return ",".join(steps)
