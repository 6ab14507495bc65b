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
    from posttrain.config import EvalRuntime
    from posttrain.evaluate import load_policy

    policy = load_policy(model_dir, EvalRuntime(device=device, batch_size=batch_size))
    return policy_accuracy(policy, tasks, max_new_tokens=max_new_tokens, batch_size=batch_size, device=device)


def policy_accuracy(policy, tasks: Sequence[Task], *, max_new_tokens: int, batch_size: int = 64,
                    device: str = "cpu") -> tuple[dict[str, float], list[Trajectory]]:
    """`heldout_accuracy` for an already loaded `posttrain.evaluate.Policy` (e.g. one kept up to date with a
    model in training through `engine.update_weights`)."""
    from posttrain.config import EvalRuntime, EvalSampling
    from posttrain.evaluate import ItemEpisodes, outcome_metrics, run_items

    items, _ = run_items(policy, list(tasks), EvalSampling(max_new_tokens=max_new_tokens), EvalRuntime(
        device=device, batch_size=batch_size))
    by_domain: dict[str, list[ItemEpisodes]] = defaultdict(list)
    for item in items:
        by_domain[item.task.domain].append(item)
    accuracy = {domain: outcome_metrics(group)["pass@1"] or 0.0 for domain, group in sorted(by_domain.items())}
    return accuracy, [item.greedy for item in items if item.greedy is not None]


def accuracy_by_level(trajectories: Sequence[Trajectory]) -> dict[str, dict[str, float]]:
    """Greedy pass rate per domain and difficulty level: {"arithmetic": {"3": 0.99, "4": 0.41}}."""
    passed: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for trajectory in trajectories:
        passed[trajectory.domain][str(trajectory.difficulty)].append(bool(trajectory.reward.passed))
    return {domain: {level: round(sum(v) / len(v), 4) for level, v in sorted(levels.items())}
            for domain, levels in sorted(passed.items())}


def sampled_pass_at_k(model_dir: Path, tasks: Sequence[Task], *, n: int, ks: Sequence[int], max_new_tokens: int,
                      temperature: float, seed: int, batch_size: int = 64, device: str = "cpu"
                      ) -> dict[str, dict[str, dict[str, float | None]]]:
    """pass@1 and pass@k (unbiased, from `n` sampled episodes per item at `temperature`) per domain and level:
    {"code": {"1": {"pass@1": 0.31, "pass@4": 0.55}}}."""
    from posttrain.config import EvalRuntime, EvalSampling
    from posttrain.evaluate import ItemEpisodes, by_level, load_policy, run_items

    if not tasks:
        return {}
    runtime = EvalRuntime(device=device, batch_size=batch_size)
    sampling = EvalSampling(max_new_tokens=max_new_tokens, greedy=False, n=n, k=sorted({1, *ks}),
                            temperature=temperature, seed=seed)
    items, _ = run_items(load_policy(model_dir, runtime), list(tasks), sampling, runtime)
    by_domain: dict[str, list[ItemEpisodes]] = defaultdict(list)
    for item in items:
        by_domain[item.task.domain].append(item)
    wanted = [f"pass@{k}" for k in sorted({1, *ks})]
    return {domain: {level: {key: figures.get(key) for key in wanted}
                     for level, figures in by_level(group, ks).items()}
            for domain, group in sorted(by_domain.items())}
