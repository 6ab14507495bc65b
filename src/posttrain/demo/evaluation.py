"""Held-out accuracy of a model directory on tasks, for the demo's stages: greedy episodes through one engine
(`posttrain.evaluate`), judged by each task's own verifier (the same one RL trains against)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Sequence

from posttrain.types import Task, Trajectory


def heldout_accuracy(model_dir: Path, tasks: Sequence[Task], *, max_new_tokens: int, batch_size: int = 64,
                     device: str = "cpu") -> tuple[dict[str, float], list[Trajectory]]:
    """Greedy pass rate (pass@1) per domain of the model at `model_dir` over `tasks`, and the trajectories."""
    from posttrain.config import EvalRuntime, EvalSampling
    from posttrain.evaluate import ItemEpisodes, load_policy, outcome_metrics, run_items

    policy = load_policy(model_dir, EvalRuntime(device=device, batch_size=batch_size))
    items, _ = run_items(policy, list(tasks), EvalSampling(max_new_tokens=max_new_tokens), EvalRuntime(
        device=device, batch_size=batch_size))
    by_domain: dict[str, list[ItemEpisodes]] = defaultdict(list)
    for item in items:
        by_domain[item.task.domain].append(item)
    accuracy = {domain: outcome_metrics(group)["pass@1"] or 0.0 for domain, group in sorted(by_domain.items())}
    return accuracy, [item.greedy for item in items if item.greedy is not None]
