"""Structured extraction: fill a small JSON object from a generated paragraph (person, invoice, order records).

Prompt: ``Extract name, city as JSON.\\nMaria Lopez is 34 years old and lives in Lyon. She works as a nurse.``
Answer: ``{"name": "Maria Lopez", "city": "Lyon"}``.

Built to be learnable by a ~3M-parameter model trained from scratch for minutes: the paragraph is one or two
sentences from a handful of templates, every value is copied verbatim from the text (all values are strings),
and the answer lists the asked keys in the order the prompt names them. Difficulty = number of keys asked
(level 1: 2, level 2: 3, level 3: 4); the paragraph always states all four facts, so lower levels must skip some.
Judged by the ``structured`` verifier: JSON parse, JSON-Schema validation, each field against the reference and
grounded in the source text.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Callable

from posttrain.data import SFTSample
from posttrain.tasks.base import TaskError, demo_sample, domain, task_id
from posttrain.types import Task

_FIRST = ["Maria", "John", "Aisha", "Liam", "Chen", "Sofia", "Omar", "Elena", "Noah", "Priya", "Lucas", "Hana",
          "Ivan", "Zara", "Mateo", "Nina", "Kofi", "Lena", "Arjun", "Mia", "Tomas", "Yara", "Felix", "Rosa"]
_LAST = ["Lopez", "Smith", "Khan", "Brown", "Wang", "Rossi", "Haddad", "Petrova", "Jones", "Patel", "Silva",
         "Sato", "Novak", "Ali", "Garcia", "Berg", "Mensah", "Weber", "Gupta", "Costa", "Kim", "Dubois"]
_CITIES = ["Lyon", "Oslo", "Lima", "Cairo", "Dublin", "Austin", "Porto", "Kyoto", "Accra", "Zurich", "Quito",
           "Perth", "Riga", "Tunis", "Denver", "Malaga", "Turin", "Hanoi", "Bergen", "Leeds"]
_JOBS = ["nurse", "teacher", "pilot", "chef", "lawyer", "baker", "mechanic", "farmer", "dentist", "painter",
         "plumber", "writer", "librarian", "carpenter", "pharmacist", "surveyor"]
_COMPANIES = ["Acme Ltd", "Bolt Inc", "Nova GmbH", "Orbit LLC", "Pine Co", "Delta SA", "Zenith Ltd", "Apex Inc",
              "Vista Co", "Cobalt LLC", "Summit SA", "Harbor Ltd"]
_PRODUCTS = ["desk lamp", "office chair", "monitor", "keyboard", "backpack", "kettle", "headset", "bookshelf",
             "printer", "toaster", "blender", "camera"]


def _name(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def _date(rng: random.Random) -> str:
    return f"{rng.randint(2019, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _amount(rng: random.Random) -> str:
    return f"${rng.randint(10, 9999)}.{rng.randint(0, 99):02d}"


@dataclass(frozen=True)
class _Kind:
    fields: tuple[str, ...]
    values: Callable[[random.Random], dict[str, str]]
    templates: tuple[str, ...]


_KINDS: dict[str, _Kind] = {
    "person": _Kind(
        fields=("name", "age", "city", "job"),
        values=lambda rng: {"name": _name(rng), "age": str(rng.randint(18, 90)), "city": rng.choice(_CITIES),
                            "job": rng.choice(_JOBS)},
        templates=(
            "{name} is {age} years old and lives in {city}. They work as a {job}.",
            "{name}, a {job} aged {age}, lives in {city}.",
        ),
    ),
    "invoice": _Kind(
        fields=("invoice", "customer", "amount", "date"),
        values=lambda rng: {"invoice": f"INV-{rng.randint(1000, 9999)}", "customer": rng.choice(_COMPANIES),
                            "amount": _amount(rng), "date": _date(rng)},
        templates=(
            "Invoice {invoice} was sent to {customer} on {date}. The amount due is {amount}.",
            "On {date}, {customer} received invoice {invoice} for {amount}.",
        ),
    ),
    "order": _Kind(
        fields=("order", "product", "quantity", "city"),
        values=lambda rng: {"order": f"#{rng.randint(10000, 99999)}", "product": rng.choice(_PRODUCTS),
                            "quantity": str(rng.randint(2, 60)), "city": rng.choice(_CITIES)},
        templates=(
            "Order {order} is for {quantity} units of {product}. It ships to {city}.",
            "Ship {quantity} units of {product} to {city} under order {order}.",
        ),
    ),
}


@domain("extraction")
class Extraction:
    name = "extraction"
    max_level = 3

    def __init__(self, kinds: list[str] | None = None, system_prompt: str | None = None):
        unknown = set(kinds or []) - set(_KINDS)
        if unknown:
            raise TaskError(f"extraction: unknown kinds {sorted(unknown)}; known: {', '.join(_KINDS)}")
        self.kinds = list(kinds or _KINDS)
        self.system_prompt = system_prompt

    def make_task(self, rng: random.Random, level: int) -> Task:
        kind_name = rng.choice(self.kinds)
        kind = _KINDS[kind_name]
        values = kind.values(rng)
        template = rng.randrange(len(kind.templates))
        paragraph = kind.templates[template].format(**values)
        keys = sorted(rng.sample(kind.fields, level + 1), key=kind.fields.index)
        reference = {key: values[key] for key in keys}
        prompt = f"Extract {', '.join(keys)} as JSON.\n{paragraph}"
        messages = [{"role": "user", "content": prompt}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        schema = {
            "type": "object",
            "properties": {key: {"type": "string"} for key in keys},
            "required": keys,
            "additionalProperties": False,
        }
        return Task(
            id=task_id(self.name, prompt),
            domain=self.name,
            difficulty=level,
            messages=messages,
            verifier="structured",
            verifier_args={"schema": schema, "reference": reference, "source": paragraph},
            max_steps=1,
            timeout_s=20.0,
            metadata={"problem_key": prompt, "kind": kind_name, "template": template, "answer": answer_json(reference)},
        )

    def demonstration(self, task: Task) -> SFTSample:
        return demo_sample(task, task.metadata["answer"], None)


def answer_json(reference: dict[str, str]) -> str:
    """The canonical answer: keys in the asked order, ``json.dumps`` spacing."""
    return json.dumps(reference, ensure_ascii=False)
