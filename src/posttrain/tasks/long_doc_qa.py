"""Long-document QA: a generated multi-page financial report with tables; the answer combines several pages.

A report for a fictional company and year has revenue-by-segment, operating-expense and (from level 2)
capital-expenditure tables by quarter, in $ thousands, on separate pages in shuffled order, plus at higher levels
a headcount table and narrative pages whose figures are the *prior* year's (distractors). A question names k
figures ("the Cloud revenue in Q2 minus the Marketing expenses in Q2 minus the Servers capital expenditure in Q1
plus ...") cycling over the tables, so they live on different pages; revenue counts plus, costs minus, and the
answer is the integer total.

Difficulty = length and hops: level L has L + 2 pages (plus `filler_pages` narrative pages, for longer
documents) and asks for L figures (L = 1..5). Judged by ``math``
against the integer; the demonstration's reasoning trace lists each figure with its page, then the arithmetic.
"""

from __future__ import annotations

import hashlib
import random

from posttrain.data import SFTSample
from posttrain.tasks.base import demo_sample, domain, task_id
from posttrain.types import Task

_COMPANIES = ["Northwind Analytics", "Bluefin Robotics", "Cedar Health", "Helio Foods", "Quarry Logistics",
              "Maple Software", "Ironbark Energy", "Lumen Retail", "Solace Media", "Tidewater Bank"]
_SEGMENTS = ["Cloud", "Devices", "Services", "Licensing", "Consulting", "Retail", "Wholesale", "Advertising"]
_EXPENSES = ["Salaries", "Marketing", "Research", "Rent", "Travel", "Legal"]
_DEPARTMENTS = ["Engineering", "Sales", "Support", "Finance", "Operations"]
_CAPEX = ["Servers", "Vehicles", "Buildings", "Software"]
_QUARTERS = ["Q1", "Q2", "Q3", "Q4"]


def _table(title: str, rows: dict[str, list[int]], label: str) -> str:
    lines = [title, f"| {label} | " + " | ".join(_QUARTERS) + " |"]
    lines += [f"| {name} | " + " | ".join(str(v) for v in values) + " |" for name, values in rows.items()]
    return "\n".join(lines)


def _rows(rng: random.Random, names: list[str], low: int, high: int) -> dict[str, list[int]]:
    return {name: [rng.randint(low, high) for _ in _QUARTERS] for name in names}


@domain("long_doc_qa")
class LongDocQA:
    name = "long_doc_qa"
    max_level = 5

    def __init__(self, filler_pages: int = 0, system_prompt: str | None = None):
        self.filler_pages = filler_pages  # extra narrative pages at every level, for longer documents
        self.system_prompt = system_prompt

    def make_task(self, rng: random.Random, level: int) -> Task:
        company, year = rng.choice(_COMPANIES), rng.randint(2015, 2024)
        revenue = _rows(rng, rng.sample(_SEGMENTS, rng.randint(3, 4)), 200, 4000)
        expenses = _rows(rng, rng.sample(_EXPENSES, rng.randint(3, 4)), 50, 1500)
        pages = [
            f"{company} annual report {year}\nThis report covers the fiscal year {year}. All amounts are in "
            "thousands of dollars unless stated otherwise.",
            _table(f"Revenue by segment, {year} ($ thousands)", revenue, "Segment"),
            _table(f"Operating expenses, {year} ($ thousands)", expenses, "Category"),
        ]
        capex = _rows(rng, rng.sample(_CAPEX, 3), 10, 900)
        extras = [
            _table(f"Capital expenditure, {year} ($ thousands)", capex, "Asset"),
            _table(f"Headcount by department at quarter end, {year}", _rows(rng, rng.sample(_DEPARTMENTS, 3), 5, 400),
                   "Department"),
            self._narrative(rng, year, revenue, expenses),
            self._narrative(rng, year, revenue, expenses),
        ]
        pages += extras[: level - 1] + [self._narrative(rng, year, revenue, expenses) for _ in range(self.filler_pages)]
        order = [0] + rng.sample(range(1, len(pages)), len(pages) - 1)  # the cover stays first
        pages = [pages[i] for i in order]
        # (label, table, sign, page): the figures a question may combine; capex only once its page exists.
        pools = [("revenue", revenue, 1, order.index(1) + 1), ("expenses", expenses, -1, order.index(2) + 1)]
        if level >= 2:
            pools.append(("capital expenditure", capex, -1, order.index(3) + 1))
        figures = self._figures(rng, level, pools)
        document = "\n\n".join(f"--- Page {i} ---\n{text}" for i, text in enumerate(pages, start=1))
        terms = [f"{'' if i == 0 else ('plus ' if sign > 0 else 'minus ')}the {what}"
                 for i, (sign, what, _, _) in enumerate(figures)]
        question = f"Compute {' '.join(terms)} (all in {year}, in $ thousands). Give the result as an integer."
        answer = sum(sign * value for sign, _, value, _ in figures)
        prompt = f"{document}\n\nQuestion: {question}"
        messages = [{"role": "user", "content": prompt}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        key = hashlib.sha1(prompt.encode()).hexdigest()
        arithmetic = " ".join(f"{'-' if sign < 0 else '+'} {value}" for sign, _, value, _ in figures)[2:]
        trace = "; ".join(f"{what} = {value} (page {page})" for _, what, value, page in figures)
        if len(figures) > 1:
            trace += f"; {arithmetic} = {answer}"
        return Task(
            id=task_id(self.name, key),
            domain=self.name,
            difficulty=level,
            messages=messages,
            verifier="math",
            verifier_args={"reference": str(answer)},
            max_steps=1,
            timeout_s=60.0,
            metadata={"problem_key": key, "answer": str(answer), "trace": trace, "pages": len(pages),
                      "hops": len(figures)},
        )

    def demonstration(self, task: Task) -> SFTSample:
        return demo_sample(task, f"The answer is \\boxed{{{task.metadata['answer']}}}.", task.metadata["trace"])

    @staticmethod
    def _figures(rng, level, pools):
        """`level` distinct (sign, description, value, page) picks, cycling over the tables so hops cross pages."""
        figures, used = [], set()
        for i in range(level):
            label, table, sign, page = pools[i % len(pools)]
            while True:
                row, q = rng.choice(list(table)), rng.randrange(4)
                if (label, row, q) not in used:
                    break
            used.add((label, row, q))
            figures.append((sign, f"{row} {label} in {_QUARTERS[q]}", table[row][q], page))
        return figures

    @staticmethod
    def _narrative(rng, year, revenue, expenses) -> str:
        """Management commentary quoting *prior-year* figures: numbers that look relevant and are not."""
        segment, category = rng.choice(list(revenue)), rng.choice(list(expenses))
        quarter = rng.choice(_QUARTERS)
        return (
            f"Management discussion\nCompared with {year - 1}, when {segment} revenue in {quarter} was "
            f"{rng.randint(200, 4000)} and {category} expenses in {quarter} were {rng.randint(50, 1500)}, the "
            f"company grew its customer base by {rng.randint(2, 40)} percent and opened {rng.randint(1, 9)} new "
            "offices. Figures for the prior year are unaudited."
        )
