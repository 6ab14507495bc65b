"""Which tasks the RL stage trains on next: the `TaskSampler` contract and the static mixture.

A sampler draws batches of tasks, observes the verified trajectories of each batch (for curricula and
statistics), and checkpoints its whole state so a resumed run draws exactly what the uninterrupted one
would have. The producer calls, per batch: `begin_batch(index)`, `next_batch(count)`, `observe(...)`, then
`refill(count)` and `observe(...)` again for as many refill rounds as dynamic sampling takes, and `report()`.

`StaticMixture` splits every batch over the recipe's domains by weight (largest remainder, so shares hold
batch by batch) and draws each task's level uniformly from the domain's levels; `posttrain.schedule.Scheduler`
is the full scheduler (curriculum, compensated mixing, priority, dedup, retries).
"""

from __future__ import annotations

import random
from typing import Any, Protocol, Sequence

from posttrain.config import DomainConfig
from posttrain.tasks import Domain, get_domain, split_of
from posttrain.types import Task, Trajectory


class TaskSampler(Protocol):
    def begin_batch(self, index: int) -> None: ...

    def next_batch(self, count: int) -> list[Task]: ...

    def refill(self, count: int) -> list[Task]: ...

    def observe(self, trajectories: Sequence[Trajectory], step: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def report(self) -> dict[str, float]: ...


def apportion(weights: dict[str, float], total: int, rng: random.Random) -> dict[str, int]:
    """Split `total` items by `weights`: floors first, then the largest remainders (ties broken by `rng`)."""
    mass = sum(weights.values())
    if mass <= 0:
        raise ValueError("at least one domain needs a positive weight")
    exact = {name: total * weight / mass for name, weight in weights.items()}
    counts = {name: int(value) for name, value in exact.items()}
    order = sorted(exact, key=lambda name: (-(exact[name] - counts[name]), rng.random()))
    for name in order[: total - sum(counts.values())]:
        counts[name] += 1
    return counts


def draw_task(domain: Domain, level: int, rng: random.Random, split: str = "train", max_tries: int = 1000) -> Task:
    for _ in range(max_tries):
        task = domain.make_task(rng, level)
        if split_of(task.metadata["problem_key"]) == split:
            task.metadata["split"] = split
            return task
    raise RuntimeError(f"domain {domain.name}: no {split} task at level {level} in {max_tries} draws")


class StaticMixture:
    """Fixed domain weights, levels drawn uniformly from each domain's list."""

    def __init__(self, domains: Sequence[DomainConfig], seed: int):
        self.specs = {spec.name: spec for spec in domains}
        self.domains = {spec.name: get_domain(spec.name, **spec.args) for spec in domains}
        self.rng = random.Random(seed)
        self.drawn: dict[str, int] = {name: 0 for name in self.specs}

    def begin_batch(self, index: int) -> None:
        return None

    def next_batch(self, count: int) -> list[Task]:
        counts = apportion({n: s.weight for n, s in self.specs.items()}, count, self.rng)
        tasks = []
        for name, how_many in counts.items():
            for _ in range(how_many):
                level = self.rng.choice(self.specs[name].levels)
                tasks.append(draw_task(self.domains[name], level, self.rng))
            self.drawn[name] += how_many
        return tasks

    def refill(self, count: int) -> list[Task]:
        return self.next_batch(count)

    def observe(self, trajectories: Sequence[Trajectory], step: int) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"rng": rng_state_data(self.rng), "drawn": dict(self.drawn)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.setstate(as_rng_state(state["rng"]))
        self.drawn = dict(state["drawn"])

    def report(self) -> dict[str, float]:
        total = max(1, sum(self.drawn.values()))
        return {f"mix/sampled/{name}": count / total for name, count in self.drawn.items()}


def rng_state_data(rng: random.Random) -> list:
    """A `random.Random` state as plain lists (JSON-safe)."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def as_rng_state(state: Any) -> tuple:
    # JSON round trips turn the state's tuples into lists; random.setstate wants tuples.
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
