"""Held-out accuracy of a model directory on tasks, for the demo's stages: greedy episodes through one engine
(`posttrain.evaluate`), judged by each task's own verifier (the same one RL trains against)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from posttrain.config import EvalRuntime
from posttrain.types import Task, Trajectory

ITEMS_FILE = "heldout_items.json"  # in a stage's directory: every held-out item's outcome, for paired comparisons
EPISODE_CACHE = "episode_cache"  # in the demo's directory: the stages' held-out episodes, which the report reuses
# Episodes wait for their batch on a shared 2-core CPU; queueing is not the model's timeout. The stages and the
# report use the same scale, so the report's episodes on the fixed held-out sets are the stages' (the cache's key
# holds each task's timeout).
TIMEOUT_SCALE = 3.0


def stage_runtime(run_config: Any, batch_size: int, **options: Any) -> EvalRuntime:
    """An evaluation runtime in a stage recipe's device and precision (`run_config`: its `runtime` section), for
    an engine that samples or times that stage's model as the evaluations run it."""
    return EvalRuntime(device=run_config.device, precision=run_config.precision, batch_size=batch_size, **options)


def heldout_accuracy(model_dir: Path, tasks: Sequence[Task], *, max_new_tokens: int, batch_size: int = 64,
                     device: str = "cpu", episode_cache: str | None = None, timeout_scale: float = 1.0
                     ) -> tuple[dict[str, float], list[Trajectory]]:
    """Greedy pass rate (pass@1) per domain of the model at `model_dir` over `tasks`, and the trajectories
    (episodes kept in and reused from `episode_cache` when given: `posttrain.evaluate.cache`)."""
    from posttrain.evaluate import load_policy

    policy = load_policy(model_dir, EvalRuntime(device=device, batch_size=batch_size))
    return policy_accuracy(policy, tasks, max_new_tokens=max_new_tokens, batch_size=batch_size, device=device,
                           episode_cache=episode_cache, timeout_scale=timeout_scale)


def policy_accuracy(policy, tasks: Sequence[Task], *, max_new_tokens: int, batch_size: int = 64,
                    device: str = "cpu", episode_cache: str | None = None, timeout_scale: float = 1.0
                    ) -> tuple[dict[str, float], list[Trajectory]]:
    """`heldout_accuracy` for an already loaded `posttrain.evaluate.Policy` (e.g. one kept up to date with a
    model in training through `engine.update_weights`: its `settings` must then be None, so nothing is cached
    under the checkpoint it was loaded from)."""
    from posttrain.config import EvalSampling
    from posttrain.evaluate import ItemEpisodes, outcome_metrics, run_items

    items, _ = run_items(policy, list(tasks), EvalSampling(max_new_tokens=max_new_tokens), EvalRuntime(
        device=device, batch_size=batch_size, episode_cache=episode_cache, timeout_scale=timeout_scale))
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
                      temperature: float, seed: int, batch_size: int = 64, device: str = "cpu",
                      episode_cache: str | None = None, timeout_scale: float = 1.0
                      ) -> tuple[dict[str, dict[str, dict[str, float | None]]], dict[str, dict[str, float]]]:
    """pass@1 and pass@k (unbiased, from `n` sampled episodes per item at `temperature`) per domain and level,
    {"code": {"1": {"pass@1": 0.31, "pass@4": 0.55}}}, and each item's share of passing samples per domain,
    {"code": {task id: 0.375}} (what `paired_difference` compares between stages)."""
    from posttrain.config import EvalSampling
    from posttrain.evaluate import ItemEpisodes, by_level, item_pass_rates, load_policy, run_items

    if not tasks:
        return {}, {}
    runtime = EvalRuntime(device=device, batch_size=batch_size, episode_cache=episode_cache,
                          timeout_scale=timeout_scale)
    sampling = EvalSampling(max_new_tokens=max_new_tokens, greedy=False, n=n, k=sorted({1, *ks}),
                            temperature=temperature, seed=seed)
    items, _ = run_items(load_policy(model_dir, runtime), list(tasks), sampling, runtime)
    by_domain: dict[str, list[ItemEpisodes]] = defaultdict(list)
    for item in items:
        by_domain[item.task.domain].append(item)
    wanted = [f"pass@{k}" for k in sorted({1, *ks})]
    figures = {domain: {level: {key: values.get(key) for key in wanted} for level, values in by_level(group, ks).items()}
               for domain, group in sorted(by_domain.items())}
    return figures, {domain: item_pass_rates(group) for domain, group in sorted(by_domain.items())}


def greedy_pass_rates(trajectories: Sequence[Trajectory]) -> dict[str, dict[str, float]]:
    """Each held-out item's greedy outcome (0 or 1) by domain and task id; infrastructure failures left out."""
    rates: dict[str, dict[str, float]] = defaultdict(dict)
    for trajectory in trajectories:
        if not trajectory.reward.is_infrastructure_failure:
            rates[trajectory.domain][trajectory.task_id] = float(trajectory.reward.passed)
    return dict(sorted(rates.items()))


def write_item_rates(stage_dir: Path, greedy: dict[str, dict[str, float]],
                     sampled: dict[str, dict[str, float]]) -> None:
    """A stage's per-item outcomes on the held-out sets: greedy (0/1) and, for the sampled domains, each item's
    share of passing samples, by domain and task id."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    (stage_dir / ITEMS_FILE).write_text(json.dumps({"greedy": greedy, "sampled": sampled}))


def read_item_rates(root: Path, stages: Sequence[str]) -> dict[str, dict[str, Any]]:
    """`write_item_rates`'s files of the stages that have one (a run from before they were written has none)."""
    found = {}
    for stage in stages:
        path = root / stage / ITEMS_FILE
        if path.is_file():
            found[stage] = json.loads(path.read_text())
    return found
