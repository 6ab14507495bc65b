"""reasoning-gym: every procedural generator of the installed `reasoning_gym` package as a task domain.

    get_domain("reasoning_gym/basic_arithmetic")            # one domain per generator
    get_domain("reasoning_gym", dataset="basic_arithmetic")  # the same, by keyword
    reasoning_gym_names()                                     # every generator installed

Levels come from the generator's curriculum (level L sets every curriculum attribute to level L - 1, capped at
the attribute's last level, ranges inclusive of the easier levels as reasoning-gym does by default); a generator
without a curriculum, or one given an explicit `config`, has one level. Some curricula of reasoning-gym 0.1.x
cannot build their top levels (an assertion in the generator's config): asking for such a level is a `TaskError`
naming the generator's complaint.

The model answers inside ``<answer>...</answer>`` (the instruction is the system prompt). The ``reasoning_gym``
verifier (`posttrain.verify`) scores the answer against the entry (kept JSON-safe in ``verifier_args``) with the
generator's own scorer in the sandbox, wrapped with exact-match so partial credit for an answer that merely
*contains* the right one is not paid. The generator's config and the entry's index are in the metadata. A few
generators have no reference answer (any valid solution scores, e.g. graph colouring); they cannot emit
demonstrations.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

from posttrain.data import SFTSample
from posttrain.tasks.base import DOMAINS, TaskError, demo_sample, domain, task_id
from posttrain.types import Task

PREFIX = "reasoning_gym/"
DEFAULT_SYSTEM_PROMPT = (
    "Think step by step, then give only the final answer between <answer> and </answer> tags."
)
DATASET_SIZE = 1_000_000  # entries are generated on demand from (seed, index): size is only the index range


def reasoning_gym_names() -> list[str]:
    """Every generator of the installed reasoning-gym, sorted (empty when it is not installed)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        return []
    return sorted(DATASETS)


@domain("reasoning_gym")
class ReasoningGym:
    def __init__(self, dataset: str, config: dict[str, Any] | None = None, seed: int = 0,
                 system_prompt: str | None = DEFAULT_SYSTEM_PROMPT):
        try:
            from reasoning_gym.factory import DATASETS, has_curriculum
        except ImportError:
            raise TaskError("reasoning_gym domains need the reasoning-gym package: pip install reasoning-gym") from None
        if dataset not in DATASETS:
            import difflib

            close = difflib.get_close_matches(dataset, list(DATASETS), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise TaskError(f"reasoning_gym: unknown dataset '{dataset}'{hint}")
        self.dataset = dataset
        self.name = PREFIX + dataset
        self.config = dict(config or {})
        self.seed = seed
        self.system_prompt = system_prompt
        self._curriculum = None
        if not self.config and has_curriculum(dataset):
            from reasoning_gym.factory import create_curriculum

            self._curriculum = create_curriculum(dataset)
        attributes = self._curriculum.attributes.values() if self._curriculum else []
        self.max_level = max((len(a.levels) for a in attributes), default=1)
        self._datasets: dict[int, Any] = {}

    def make_task(self, rng: random.Random, level: int) -> Task:
        generator, config = self._generator(level)
        index = rng.randrange(DATASET_SIZE)
        try:
            entry = generator[index]
        except Exception as error:
            raise TaskError(f"{self.name} level {level}: the generator failed on entry {index} ({error})") from None
        question = str(entry["question"])
        messages = [{"role": "user", "content": question}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        answer = entry.get("answer")
        return Task(
            id=task_id(self.name, question),
            domain=self.name,
            difficulty=level,
            messages=messages,
            verifier="reasoning_gym",
            verifier_args={"dataset": self.dataset, "entry": _jsonable(entry)},
            max_steps=1,
            timeout_s=60.0,
            metadata={"problem_key": f"{self.dataset}:{question}", "answer": None if answer is None else str(answer),
                      "config": config, "index": index},
        )

    def demonstration(self, task: Task) -> SFTSample:
        answer = task.metadata.get("answer")
        if answer is None:
            raise TaskError(f"{self.name}: the generator gives no reference answer, so no demonstration")
        return demo_sample(task, f"<answer>{answer}</answer>", None, source="reasoning_gym")

    def _generator(self, level: int) -> tuple[Any, dict[str, Any]]:
        if level not in self._datasets:
            from reasoning_gym.factory import DATASETS

            dataset_cls, config_cls = DATASETS[self.dataset]
            try:
                if self._curriculum is not None:
                    self._curriculum.set_global_level(level - 1)
                    config = self._curriculum.generate_configuration({"seed": self.seed, "size": DATASET_SIZE})
                else:
                    config = config_cls(**{"seed": self.seed, "size": DATASET_SIZE, **self.config})
                if hasattr(config, "validate"):
                    config.validate()
                generator = dataset_cls(config=config)
            except Exception as error:
                raise TaskError(f"{self.name}: cannot build level {level} ({type(error).__name__}: {error})") from None
            self._datasets[level] = (generator, _jsonable(dataclasses.asdict(config)))
        return self._datasets[level]


def _jsonable(value: Any) -> Any:
    """A JSON-safe copy (tuples and sets become lists, other objects their repr), so tasks serialize."""
    try:
        return json.loads(json.dumps(value, default=_fallback))
    except (TypeError, ValueError):
        return repr(value)


def _fallback(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    return repr(value)


def register_all() -> None:
    """Register ``reasoning_gym/<name>`` for every installed generator (done lazily by `get_domain`)."""
    for name in reasoning_gym_names():
        DOMAINS.setdefault(PREFIX + name, _factory(name))


def _factory(dataset: str):
    def make(**kwargs: Any) -> ReasoningGym:
        return ReasoningGym(dataset=dataset, **kwargs)

    make.__name__ = f"reasoning_gym_{dataset}"
    return make
