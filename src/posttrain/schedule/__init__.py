"""Scheduling: which tasks to train on next across domains (mixing, curricula, retries, forgetting guard).

    from posttrain.schedule import Scheduler
    scheduler = Scheduler(recipe.domains, recipe.schedule, seed=recipe.runtime.seed)

`Scheduler` is the RL stage's default `TaskSampler`: compensated domain mixing (static, staged, adaptive),
a pass-rate curriculum per domain with priority sampling over a task pool, dedup and infrastructure retries,
all checkpointed exactly. `ForgettingGuard` and `CollapseMonitor` watch evaluations and training signals for
the trainer. See docs/schedule.md for every knob.
"""

from posttrain.schedule.alarms import ALARM_KINDS, CollapseMonitor
from posttrain.schedule.curriculum import LevelController, TaskPool, priority_weight
from posttrain.schedule.groups import DROPPED_KEY, group_outcome, is_dropped, is_kept, scored_members, split_groups
from posttrain.schedule.guard import ForgettingGuard, replay_samples
from posttrain.schedule.mixing import DomainMixer
from posttrain.schedule.sampler import StaticMixture, TaskSampler, apportion, draw_task
from posttrain.schedule.scheduler import Scheduler
from posttrain.schedule.stats import TaskStats, TaskStatsStore

__all__ = [
    "ALARM_KINDS",
    "DROPPED_KEY",
    "CollapseMonitor",
    "DomainMixer",
    "ForgettingGuard",
    "LevelController",
    "Scheduler",
    "StaticMixture",
    "TaskPool",
    "TaskSampler",
    "TaskStats",
    "TaskStatsStore",
    "apportion",
    "draw_task",
    "group_outcome",
    "is_dropped",
    "is_kept",
    "priority_weight",
    "replay_samples",
    "scored_members",
    "split_groups",
]
