"""Fractions: the sum of two proper fractions, judged by the `math` verifier (exact rationals, then math-verify).

Prompt: ``3/4+1/6``. Demonstrated answer: ``Answer: 11/12``; the reasoning trace brings both to the least common
denominator and reduces: ``lcd 12: 9/12+2/12=11/12``. Any equal rational is right (``22/24``, ``0.9166...`` is not:
the verifier compares exactly), and a hedge or two different answers score 0 (see `posttrain.verify.math_answer`).

One level: denominators 2..`max_denominator` (default 10, about two thousand distinct problems, a tenth of them
held out by the problem's hash).
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

from posttrain.data import SFTSample
from posttrain.tasks.base import TaskError, demo_sample, domain, task_id, user_messages
from posttrain.types import Task


@domain("fractions")
class Fractions:
    name = "fractions"
    max_level = 1

    def __init__(self, max_denominator: int = 10, system_prompt: str | None = None):
        if not 3 <= max_denominator <= 99:
            raise TaskError(f"fractions: max_denominator must be in 3..99, got {max_denominator}")
        self.max_denominator = max_denominator
        self.system_prompt = system_prompt

    def make_task(self, rng: random.Random, level: int) -> Task:
        if level != 1:
            raise TaskError(f"fractions: one level (1), got {level}")
        b, d = rng.randint(2, self.max_denominator), rng.randint(2, self.max_denominator)
        a, c = rng.randint(1, b - 1), rng.randint(1, d - 1)
        problem = f"{a}/{b}+{c}/{d}"
        answer = _text(Fraction(a, b) + Fraction(c, d))
        return Task(
            id=task_id(self.name, problem),
            domain=self.name,
            difficulty=level,
            messages=user_messages(problem, self.system_prompt),
            verifier="math",
            verifier_args={"reference": answer},
            max_steps=1,
            timeout_s=10.0,
            metadata={"problem_key": problem, "answer": answer, "terms": [a, b, c, d]},
        )

    def demonstration(self, task: Task) -> SFTSample:
        a, b, c, d = task.metadata["terms"]
        return demo_sample(task, f"Answer: {task.metadata['answer']}", lcd_trace(a, b, c, d))


def lcd_trace(a: int, b: int, c: int, d: int) -> str:
    """'lcd 12: 9/12+2/12=11/12', with the reduction when there is one: 'lcd 6: 3/6+1/6=4/6=2/3'."""
    lcd = b * d // math.gcd(b, d)
    left, right = a * lcd // b, c * lcd // d
    total = left + right
    trace = f"lcd {lcd}: {left}/{lcd}+{right}/{lcd}={total}/{lcd}"
    reduced = _text(Fraction(total, lcd))
    return trace if reduced == f"{total}/{lcd}" else f"{trace}={reduced}"


def _text(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
