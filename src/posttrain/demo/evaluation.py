"""Held-out accuracy of a model directory on tasks: greedy episodes through the engine, judged by each
task's own verifier (the same one RL trains against)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from posttrain.types import SamplingParams, Task, Trajectory


def heldout_accuracy(model_dir: Path, tasks: Sequence[Task], *, max_new_tokens: int, batch_size: int = 64,
                     device: str = "cpu") -> tuple[dict[str, float], list[Trajectory]]:
    """Greedy pass rate per domain of the model at `model_dir` over `tasks`."""
    from posttrain.config import ModelConfig
    from posttrain.envs import run_episodes
    from posttrain.models import load_model, load_tokenizer
    from posttrain.rollout import HFEngine

    config = ModelConfig(path=str(model_dir))
    tokenizer = load_tokenizer(config)
    model = load_model(config, tokenizer, device)
    engine = HFEngine(model, tokenizer, max_batch_size=batch_size)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    trajectories = run_episodes(engine, list(tasks), tokenizer, sampling)
    return accuracy_by_domain(trajectories), trajectories


def accuracy_by_domain(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    passed: dict[str, list[bool]] = defaultdict(list)
    for trajectory in trajectories:
        passed[trajectory.domain].append(bool(trajectory.reward.passed))
    return {domain: sum(values) / len(values) for domain, values in sorted(passed.items())}


def mean_accuracy(figures: dict[str, Any]) -> float:
    values = list(figures.values())
    return sum(values) / len(values) if values else 0.0
