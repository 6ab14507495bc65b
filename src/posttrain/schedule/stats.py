"""Per-task statistics: what the scheduler knows about every task it has tried.

For each task id: episodes scored (`attempts`), groups, an exponential moving average of the group pass rate
(`pass_ema`, the first group sets it; then ``ema * old + (1 - ema) * group_pass_rate``), the mean and standard
deviation of all its rewards (Welford's running update, exact in any order of groups), and the batch index it
was last seen at. Infrastructure failures never enter these numbers: they say nothing about the policy.

The store keeps the `capacity` most recently seen tasks (generated domains produce endless fresh tasks), and
its state is plain data, so a checkpoint restores it exactly.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Iterable


@dataclass
class TaskStats:
    domain: str
    level: int
    attempts: int = 0  # scored episodes
    groups: int = 0
    passes: int = 0
    pass_ema: float = 0.0
    reward_mean: float = 0.0
    reward_m2: float = 0.0  # sum of squared deviations from the mean (Welford)
    last_step: int = -1

    @property
    def reward_std(self) -> float:
        return math.sqrt(self.reward_m2 / self.attempts) if self.attempts else 0.0

    def add_group(self, scores: Iterable[float], passed: Iterable[bool], step: int, ema: float) -> None:
        scores, passed = list(scores), list(passed)
        if not scores:
            return
        for score in scores:
            self.attempts += 1
            delta = score - self.reward_mean
            self.reward_mean += delta / self.attempts
            self.reward_m2 += delta * (score - self.reward_mean)
        rate = sum(passed) / len(passed)
        self.pass_ema = rate if self.groups == 0 else ema * self.pass_ema + (1 - ema) * rate
        self.groups += 1
        self.passes += sum(passed)
        self.last_step = step


class TaskStatsStore:
    """Task id -> `TaskStats`, least recently seen dropped beyond `capacity`."""

    def __init__(self, ema: float = 0.5, capacity: int = 100_000):
        self.ema, self.capacity = ema, capacity
        self._tasks: OrderedDict[str, TaskStats] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tasks)

    def __contains__(self, task_id: str) -> bool:
        return task_id in self._tasks

    def get(self, task_id: str) -> TaskStats | None:
        return self._tasks.get(task_id)

    def record(self, task_id: str, domain: str, level: int, scores: Iterable[float], passed: Iterable[bool],
               step: int) -> TaskStats:
        """Add one group of scored (non-infrastructure) episodes of a task seen at batch `step`."""
        stats = self._tasks.pop(task_id, None) or TaskStats(domain=domain, level=level)
        stats.add_group(scores, passed, step, self.ema)
        self._tasks[task_id] = stats  # most recently seen last
        while len(self._tasks) > self.capacity:
            self._tasks.popitem(last=False)
        return stats

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self.ema, "capacity": self.capacity,
                "tasks": [[task_id, asdict(stats)] for task_id, stats in self._tasks.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema, self.capacity = state["ema"], state["capacity"]
        self._tasks = OrderedDict((task_id, TaskStats(**stats)) for task_id, stats in state["tasks"])
