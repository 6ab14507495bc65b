"""Difficulty curriculum: a level per domain moved by the measured pass rate, and priority sampling of tasks.

Levels. Each domain sits at one of its recipe `levels`. Every scored episode of a task at the current level
enters a window of the last `window` outcomes; once `min_episodes` have been seen since the last move, a window
pass rate >= `upper` moves the level up and <= `lower` moves it down. The gap between the bands and the fresh
window after a move are the hysteresis: a level is never left on the strength of the previous level's episodes.

Priority. Tasks come from a pool of `pool_size` candidates per domain (fresh tasks top it up). A task with
measured pass rate s (its `TaskStats.pass_ema`; for a task never seen, the pass rate of its level so far, or
`prior`) is drawn with probability proportional to

    variance: max(floor, 4 s (1 - s))    failure: max(floor, 1 - s)    uniform: 1

so tasks the policy sometimes solves (the ones whose groups have reward spread) come back, while solved and
hopeless ones fade. A task leaves the pool after `max_visits` groups, when it settles at the floor weight, or when
it is retired: solved at `retire_pass_rate` or better over at least `retire_min_episodes` episodes. Retired
tasks are re-probed with probability `reprobe_prob` per draw; one that fails its re-probe returns to the pool.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable

from posttrain.config import CurriculumConfig, PriorityConfig
from posttrain.schedule.stats import TaskStats
from posttrain.types import Task


def priority_weight(pass_rate: float, weighting: str, floor: float) -> float:
    if weighting == "uniform":
        return 1.0
    raw = 4.0 * pass_rate * (1.0 - pass_rate) if weighting == "variance" else 1.0 - pass_rate
    return max(floor, raw)


class LevelController:
    """The current level of one domain and the evidence for moving it."""

    def __init__(self, levels: list[int], config: CurriculumConfig, start: int | None = None):
        self.levels = sorted(set(levels))
        self.config = config
        self.index = self.levels.index(start) if start is not None else 0
        self.window: deque[bool] = deque(maxlen=config.window)
        self.since_move = 0
        self.moves = 0
        self.peak = self.level

    @property
    def level(self) -> int:
        return self.levels[self.index]

    def pass_rate(self) -> float | None:
        return sum(self.window) / len(self.window) if self.window else None

    def observe(self, level: int, passed: list[bool]) -> int:
        """Count the episodes of a group at `level`; returns the move made (+1 up, -1 down, 0)."""
        if not self.config.enabled or level != self.level or not passed:
            return 0
        self.window.extend(passed)
        self.since_move += len(passed)
        if self.since_move < self.config.min_episodes:
            return 0
        rate = self.pass_rate()
        if rate >= self.config.upper and self.index < len(self.levels) - 1:
            return self._move(+1)
        if rate <= self.config.lower and self.index > 0:
            return self._move(-1)
        return 0

    def _move(self, direction: int) -> int:
        self.index += direction
        self.window.clear()
        self.since_move = 0
        self.moves += 1
        self.peak = max(self.peak, self.level)
        return direction

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index, "window": list(self.window), "since_move": self.since_move,
                "moves": self.moves, "peak": self.peak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index, self.since_move = state["index"], state["since_move"]
        self.moves, self.peak = state["moves"], state["peak"]
        self.window = deque(state["window"], maxlen=self.config.window)


@dataclass
class _Candidate:
    task: Task
    visits: int = 0


class TaskPool:
    """One domain's candidate tasks, its retired tasks, and the retired tasks out on a re-probe."""

    def __init__(self, config: PriorityConfig):
        self.config = config
        self.candidates: OrderedDict[str, _Candidate] = OrderedDict()
        self.retired: OrderedDict[str, Task] = OrderedDict()
        self.probing: OrderedDict[str, Task] = OrderedDict()
        self.counts = {"reprobes": 0, "retired": 0, "unretired": 0, "expired": 0, "settled": 0}

    def __contains__(self, task_id: str) -> bool:
        return task_id in self.candidates or task_id in self.retired or task_id in self.probing

    def draw(self, rng: random.Random, fresh: Callable[[], Task], eligible: Callable[[Task], bool],
             pass_rate: Callable[[Task], float]) -> Task:
        """One task: a retired one on a re-probe, else a pool candidate by priority weight."""
        if self.retired and self.config.reprobe_prob > 0 and rng.random() < self.config.reprobe_prob:
            choices = [task for task in self.retired.values() if eligible(task)]
            if choices:
                task = rng.choice(choices)
                self.probing[task.id] = self.retired.pop(task.id)
                self.counts["reprobes"] += 1
                return task
        for _ in range(self.config.pool_size - len(self.candidates)):  # bounded: a fresh draw may repeat one
            self.add(fresh())
        choices = [c for c in self.candidates.values() if eligible(c.task)]
        if not choices:  # everything in the pool was drawn within the dedup window
            task = fresh()
            self.add(task)
            choices = [self.candidates[task.id]]
        weights = [priority_weight(pass_rate(c.task), self.config.weighting, self.config.floor) for c in choices]
        chosen = rng.choices(choices, weights=weights)[0] if len(choices) > 1 else choices[0]
        chosen.visits += 1
        return chosen.task

    def add(self, task: Task) -> None:
        self.candidates.setdefault(task.id, _Candidate(task))

    def observe(self, task_id: str, stats: TaskStats) -> None:
        """After a group of `task_id` was scored: retire, un-retire, or let it leave the pool."""
        config = self.config
        solved = stats.pass_ema >= config.retire_pass_rate and stats.attempts >= config.retire_min_episodes
        if task_id in self.probing:
            task = self.probing.pop(task_id)
            if solved:
                self._retire(task)
            else:
                self.counts["unretired"] += 1
                self.candidates[task_id] = _Candidate(task, visits=1)
            return
        candidate = self.candidates.get(task_id)
        if candidate is None:
            return
        settled = (stats.attempts >= config.retire_min_episodes
                   and priority_weight(stats.pass_ema, config.weighting, config.floor) <= config.floor)
        if solved:
            del self.candidates[task_id]
            self._retire(candidate.task)
        elif candidate.visits >= config.max_visits:
            del self.candidates[task_id]
            self.counts["expired"] += 1
        elif settled:
            del self.candidates[task_id]
            self.counts["settled"] += 1

    def discard(self, task_id: str) -> None:
        """A task lost to infrastructure failures leaves the pool: the retry queue owns its retries."""
        self.candidates.pop(task_id, None)
        self.probing.pop(task_id, None)

    def keep_only_level(self, level: int) -> None:
        """After a level move: candidates of other levels make room for fresh ones of the new level."""
        for task_id in [i for i, c in self.candidates.items() if c.task.difficulty != level]:
            del self.candidates[task_id]

    def _retire(self, task: Task) -> None:
        if self.config.max_retired == 0:
            return
        self.retired[task.id] = task
        self.counts["retired"] += 1
        while len(self.retired) > self.config.max_retired:
            self.retired.popitem(last=False)

    def state_dict(self) -> dict[str, Any]:
        return {
            "candidates": [[c.task.to_dict(), c.visits] for c in self.candidates.values()],
            "retired": [task.to_dict() for task in self.retired.values()],
            "probing": [task.to_dict() for task in self.probing.values()],
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.candidates = OrderedDict()
        for task_data, visits in state["candidates"]:
            task = Task.from_dict(task_data)
            self.candidates[task.id] = _Candidate(task, visits)
        self.retired = OrderedDict((t["id"], Task.from_dict(t)) for t in state["retired"])
        self.probing = OrderedDict((t["id"], Task.from_dict(t)) for t in state["probing"])
        self.counts = dict(state["counts"])
