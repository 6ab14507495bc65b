"""Eval suites: named lists of tasks, each judged by its own verifier (the one RL trains against).

* ``heldout``: `n` tasks of a generated domain's held-out split (`posttrain.tasks.sample_tasks`), fixed by a seed;
* ``fresh``: as many again from the same split with a new seed, minus any problem the fixed set has, so that a
  model (or a checkpoint selection) fitted to the fixed set shows as a gap between the two;
* ``dataset``: every problem of a JSONL / Parquet / saved dataset, through the ``dataset`` domain adapter;
* ``regression``: a fixed JSONL of tasks (``Task.to_dict()`` lines), or held-out items drawn from a domain (the
  RL guard's general suites), optionally with a pass-rate floor.

`hygiene` re-checks the split of every generated suite: a held-out item must hash to the held-out side
(`posttrain.tasks.split_of`), so no training draw of that domain can ever contain it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from posttrain.config import DatasetSuite, EvalRecipe, GeneratedSuite, RegressionSuite
from posttrain.evaluate.errors import EvalError
from posttrain.tasks import TaskError, get_domain, sample_tasks, split_of
from posttrain.types import Task

KINDS = ("heldout", "fresh", "dataset", "regression")


@dataclass
class Suite:
    """`tasks` under a `name`; `group` is the table the report shows it in (a domain: its held-out and fresh
    suites side by side)."""

    name: str
    kind: str
    group: str
    tasks: list[Task]
    seed: int | None = None
    min_pass_rate: float | None = None
    heldout_fraction: float | None = None  # generated suites: the split they were drawn from
    domain_args: dict[str, Any] = field(default_factory=dict)
    excluded: list[str] = field(default_factory=list)  # task ids removed as contaminated

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name, "kind": self.kind, "group": self.group, "items": len(self.tasks),
            "levels": sorted({t.difficulty for t in self.tasks}), "seed": self.seed,
            "min_pass_rate": self.min_pass_rate, "excluded": len(self.excluded),
        }


def build_suites(recipe: EvalRecipe, fresh_seed: int | None = None) -> list[Suite]:
    """Every suite the recipe names, a fresh draw after each generated one when the recipe asks for it
    (with `fresh_seed`, else the recipe's `fresh_draw.seed`, else a new seed)."""
    if fresh_seed is None:
        fresh_seed = recipe.fresh_draw.seed if recipe.fresh_draw.seed is not None else new_fresh_seed()
    suites: list[Suite] = []
    for spec in recipe.suites.generated:
        fixed = generated_suite(spec)
        suites.append(fixed)
        if recipe.fresh_draw.enabled:
            suites.append(fresh_draw(fixed, spec.domain, spec.levels, fresh_seed))
    suites += [dataset_suite(spec) for spec in recipe.suites.datasets]
    suites += [regression_suite(spec) for spec in recipe.suites.regression]
    return suites


def generated_suite(spec: GeneratedSuite) -> Suite:
    name = spec.name or spec.domain
    tasks = _draw(spec.domain, spec.args, spec.n, spec.levels, spec.seed, spec.heldout_fraction, name)
    return Suite(name, "heldout", name, tasks, seed=spec.seed, heldout_fraction=spec.heldout_fraction,
                 domain_args=dict(spec.args))


def fresh_draw(fixed: Suite, domain: str, levels: Sequence[int], seed: int) -> Suite:
    """As many held-out tasks as `fixed` has, drawn with `seed`, without the problems `fixed` holds.

    Domains whose held-out split is small give fewer (the shortfall shows in the suite's item count)."""
    fraction = fixed.heldout_fraction or 0.1
    taken = {t.metadata.get("problem_key") for t in fixed.tasks}
    wanted = len(fixed.tasks)
    tasks: list[Task] = []
    for count in (wanted + len(taken), wanted):  # ask for spare items first; a small split may not have them
        try:
            drawn = _draw(domain, fixed.domain_args, count, levels, seed, fraction, f"{fixed.name} (fresh)")
        except EvalError:
            continue
        tasks = [t for t in drawn if t.metadata.get("problem_key") not in taken][:wanted]
        break
    return Suite(f"{fixed.name} (fresh)", "fresh", fixed.group, tasks, seed=seed, heldout_fraction=fraction,
                 domain_args=dict(fixed.domain_args))


def tasks_suite(name: str, tasks: Sequence[Task], *, kind: str = "heldout", group: str | None = None,
                domain_args: dict[str, Any] | None = None, seed: int | None = None,
                heldout_fraction: float | None = 0.1, min_pass_rate: float | None = None) -> Suite:
    """A suite from tasks already in hand (the demo's saved held-out sets)."""
    if kind not in KINDS:
        raise EvalError(f"suite {name!r}: kind must be one of {KINDS}, got {kind!r}")
    return Suite(name, kind, group or name, list(tasks), seed=seed, min_pass_rate=min_pass_rate,
                 heldout_fraction=heldout_fraction, domain_args=dict(domain_args or {}))


def dataset_suite(spec: DatasetSuite) -> Suite:
    try:
        source = get_domain("dataset", path=spec.path, domain_name=spec.name, **spec.args)
        tasks = source.tasks(None if spec.split == "all" else spec.split)
    except TaskError as error:
        raise EvalError(f"suites.datasets '{spec.name}': {error}") from None
    if spec.limit:
        tasks = tasks[: spec.limit]
    if not tasks:
        raise EvalError(f"suites.datasets '{spec.name}': no items in {spec.path} (split {spec.split})")
    return Suite(spec.name, "dataset", spec.name, tasks)


def regression_suite(spec: RegressionSuite, seed: int = 0) -> Suite:
    """The tasks of a regression suite: the lines of its JSONL file (its `domain`, if set too, is only what the RL
    guard replays), or `spec.items` held-out items of its domain drawn with `seed` (the RL guard's general suites)."""
    if spec.path is None:
        try:
            tasks = sample_tasks(get_domain(spec.domain, **spec.args), spec.items, level=list(spec.levels),
                                 split="heldout", seed=seed)
        except TaskError as error:
            raise EvalError(f"regression suite '{spec.name}': {error}") from None
        return Suite(spec.name, "regression", spec.name, tasks, seed=seed, min_pass_rate=spec.min_pass_rate,
                     domain_args=dict(spec.args))
    path = Path(spec.path)
    if not path.is_file():
        raise EvalError(f"suites.regression '{spec.name}': {path}: no such file")
    tasks = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            tasks.append(Task.from_dict(json.loads(line)))
        except (json.JSONDecodeError, TypeError, KeyError) as error:
            raise EvalError(f"{path}:{line_no}: not a task ({type(error).__name__}: {error}); a regression "
                            "suite is JSONL of Task.to_dict() records") from None
    if spec.items:
        tasks = tasks[: spec.items]
    return Suite(spec.name, "regression", spec.name, tasks, min_pass_rate=spec.min_pass_rate)


def hygiene(suites: Sequence[Suite]) -> list[dict[str, Any]]:
    """Per generated suite: how many items are not on the held-out side of their domain's split (must be 0)."""
    rows = []
    for suite in suites:
        if suite.kind not in ("heldout", "fresh") or suite.heldout_fraction is None:
            continue
        keys = [t.metadata.get("problem_key") for t in suite.tasks]
        outside = [k for k in keys if k is None or split_of(str(k), suite.heldout_fraction) != "heldout"]
        rows.append({"suite": suite.name, "items": len(keys), "outside_heldout": len(outside),
                     "examples": [str(k) for k in outside[:3]]})
    return rows


def by_suite(suites: Sequence[Any], items: Sequence[Any]) -> Iterator[tuple[Any, list[Any]]]:
    """Each suite with its items: `items` come in suite order, as `run_items` returns them for the suites' tasks."""
    start = 0
    for suite in suites:
        yield suite, list(items[start:start + len(suite.tasks)])
        start += len(suite.tasks)


def new_fresh_seed() -> int:
    """A seed no recipe wrote down: the fresh draw is new every run (and recorded in the results)."""
    return random.SystemRandom().randrange(10**6, 10**9)


def _draw(domain: str, args: dict[str, Any], count: int, levels: Sequence[int], seed: int, fraction: float,
          name: str) -> list[Task]:
    try:
        source = get_domain(domain, **args)
        return sample_tasks(source, count, level=list(levels), split="heldout", seed=seed,
                            heldout_fraction=fraction)
    except TaskError as error:
        raise EvalError(f"suite '{name}': {error}") from None
