"""Reinforcement learning: advantages, the RL step, the async rollout pipeline."""

from posttrain.rl.advantages import compute_advantages, normalize_per_domain

__all__ = ["compute_advantages", "normalize_per_domain"]
