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

Long documents: with `lengths` (tokens, increasing), level L is instead filled to ``lengths[L - 1]`` tokens with
more narrative pages (prior-year figures and filler sentences, `posttrain.tasks.haystack`) and asks for
min(L, 5) figures, so ``lengths=[1024, 2048, 4096, 8192, 16384, 32768]`` gives six levels up to 32k tokens.
Those tasks carry the heat map's ``length``, ``context_tokens`` and ``depth`` (where the first page holding a
figure starts) like the other long-context domains.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Sequence

from posttrain.data import SFTSample
from posttrain.tasks.base import TaskError, demo_sample, domain, task_id
from posttrain.tasks.haystack import Filler, TokenCounter, check_lengths, level_length
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

    def __init__(self, filler_pages: int = 0, system_prompt: str | None = None, lengths: Sequence[int] | None = None,
                 tokenizer: Any = None, chars_per_token: float = 4.0, reserve_tokens: int = 32):
        self.filler_pages = filler_pages  # extra narrative pages at every level, for longer documents
        self.system_prompt = system_prompt
        self.lengths = check_lengths(lengths, self.name, minimum=256) if lengths is not None else None
        if self.lengths is not None:
            self.max_level = len(self.lengths)
            self.counter = TokenCounter(tokenizer, chars_per_token)
            self.filler = Filler(self.counter)
            self.reserve_tokens = reserve_tokens
            self._markers: list[int] = []
            self._separator_tokens = self.counter.count("\n\n")

    def make_task(self, rng: random.Random, level: int) -> Task:
        length = level_length(self.lengths, level, self.name) if self.lengths else None
        level_asked, level = level, min(level, 5)  # the tables and hops of level min(L, 5)
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
        long_pages, base_tokens = [], []
        if length is not None:
            base_tokens = self.counter.counts(pages)
            long_pages = self._long_pages(rng, year, revenue, expenses, sum(base_tokens), len(pages), level,
                                          length - self.reserve_tokens)
        first_long = len(pages)
        pages += [self._long_text(page) for page in long_pages]
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
        long_metadata = {}
        if length is not None:
            page_tokens = base_tokens + [head_tokens + sum(self.filler.tokens[i] for i in picks)
                                         for _, head_tokens, picks in long_pages]
            summed = (sum(self._marker_tokens(len(pages))[:len(pages)]) + sum(page_tokens)
                      + self._separator_tokens * (len(pages) - 1) + self.counter.count(f"\n\nQuestion: {question}"))
            tokens = summed if self.counter.additive else self.counter.count(prompt)
            while tokens > length - self.reserve_tokens:  # the question's allowance was short: trim filler
                trimmed = [page for page in long_pages if page[2]]
                if not trimmed:
                    raise TaskError(f"long_doc_qa: level {level_asked} ({length} tokens) cannot hold the report's "
                                    "tables; raise its length")
                while tokens > length - self.reserve_tokens and any(page[2] for page in trimmed):
                    longest = max(trimmed, key=lambda page: len(page[2]))
                    tokens -= self.filler.tokens[longest[2].pop()]
                for position, index in enumerate(order):
                    if index >= first_long:
                        pages[position] = self._long_text(long_pages[index - first_long])
                document = "\n\n".join(f"--- Page {i} ---\n{text}" for i, text in enumerate(pages, start=1))
                prompt = f"{document}\n\nQuestion: {question}"
                if not self.counter.additive:
                    tokens = self.counter.count(prompt)
            first_page = document.find(f"--- Page {min(page for _, _, _, page in figures)} ---")
            long_metadata = {"length": length, "context_tokens": tokens,
                             "tokens_exact": self.counter.exact, "depth": round(first_page / len(document), 4)}
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
            difficulty=level_asked,
            messages=messages,
            verifier="math",
            verifier_args={"reference": str(answer)},
            max_steps=1,
            timeout_s=60.0,
            metadata={"problem_key": key, "answer": str(answer), "trace": trace, "pages": len(pages),
                      "hops": len(figures), **long_metadata},
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

    def _long_pages(self, rng, year, revenue, expenses, used: int, pages: int, hops: int, budget: int) -> list[list]:
        """Narrative pages, [prior-year paragraph, its tokens, filler sentence indices] each, until the document
        (`used` tokens in `pages` pages so far) holds about `budget` tokens with its question (allowed for)."""
        markers = self._marker_tokens(pages + 1)
        used += sum(markers[:pages]) + self._separator_tokens * pages + 40 + 20 * hops
        more: list[list] = []
        while True:
            heads = [self._narrative(rng, year, revenue, expenses) for _ in range(32)]
            for head, head_tokens in zip(heads, self.counter.counts(heads)):
                cost = head_tokens + self._marker_tokens(pages + len(more) + 1)[pages + len(more)] + \
                    self._separator_tokens
                if used + cost > budget:
                    return more
                picks = self.filler.draw(rng, min(budget - used - cost, 400))
                more.append([head, head_tokens, picks])
                used += cost + sum(self.filler.tokens[i] for i in picks)

    def _long_text(self, page: list) -> str:
        head, _, picks = page
        return head + "".join(" " + self.filler.sentences[i] for i in picks)

    def _marker_tokens(self, count: int) -> list[int]:
        """Tokens of "--- Page N ---\n" for N = 1..count (cached: the same for every task)."""
        while len(self._markers) < count:
            start = len(self._markers) + 1
            self._markers += self.counter.counts([f"--- Page {n} ---\n" for n in range(start, start + 128)])
        return self._markers

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
