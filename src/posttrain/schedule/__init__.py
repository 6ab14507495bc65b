"""Scheduling: which tasks to train on next across domains (mixing, curricula, retries, forgetting guard)."""

from posttrain.schedule.sampler import StaticMixture, TaskSampler, apportion, draw_task

__all__ = ["StaticMixture", "TaskSampler", "apportion", "draw_task"]
