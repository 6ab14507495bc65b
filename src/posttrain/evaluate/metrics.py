"""The figures of one suite's episodes: mean reward, pass@1, unbiased pass@k, process and safety metrics.

pass@k is the unbiased estimator of Chen et al. (2021), "Evaluating Large Language Models Trained on Code":
with n samples of an item of which c pass,

    pass@k = 1 - C(n - c, k) / C(n, k),      averaged over items.

The binomials overflow a float for n in the hundreds, so the ratio is taken as a product of c factors,
C(n - c, k) / C(n, k) = prod_{i = n-c+1}^{n} (1 - k / i), each in [0, 1]; it is 0 (pass@k = 1) when n - c < k.

Infrastructure failures (`Reward.is_infrastructure_failure`: the engine, a sandbox or a verifier failed) are
the system's, not the model's: they are counted, never scored. An item's n is its scored samples, and an item
with fewer than k of them does not count towards pass@k.

pass@1 comes from one greedy episode per item when the recipe runs one (`EvalSampling.greedy`), else from the
samples (c / n). The other figures (mean reward, process metrics, failure classes) are over the same
"primary" episodes: the greedy ones, else the samples.

Long-context suites (tasks whose metadata has ``length`` and ``depth``: the ``needle``, ``multi_doc_qa`` and long
``long_doc_qa`` domains) also get a length x depth grid of pass@1 (`length_depth_metrics`): rows are the levels'
lengths in tokens, columns `DEPTH_BINS` equal bins of where the evidence starts (a depth of exactly 1 falls in the
last), each cell the primary episodes' pass rate and counts.

`SuiteScore` is the short form a training loop reads (the RL forgetting guard, `SuiteEvaluator`): pass@1 and
the counts, from the same `outcome_metrics` the results JSON keeps, so a suite's pass rate is one figure
wherever it is read. A suite whose every episode failed for infrastructure reasons has no pass rate (None).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from posttrain.types import FailureClass, Task, Trajectory

FAILURE_CLASSES = [c.value for c in FailureClass if c is not FailureClass.NONE]
DEPTH_BINS = 5


@dataclass
class ItemEpisodes:
    """Everything one eval item produced: its greedy episode (if run) and its sampled ones."""

    task: Task
    greedy: Trajectory | None = None
    samples: list[Trajectory] = field(default_factory=list)

    @property
    def primary(self) -> list[Trajectory]:
        return [self.greedy] if self.greedy is not None else list(self.samples)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one item with `c` passing of `n` samples (Chen et al. 2021), computed stably."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    remaining = 1.0
    for i in range(n - c + 1, n + 1):
        remaining *= 1.0 - k / i
    return 1.0 - remaining


def _scored(trajectories: Iterable[Trajectory]) -> list[Trajectory]:
    return [t for t in trajectories if not t.reward.is_infrastructure_failure]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def outcome_metrics(items: Sequence[ItemEpisodes], ks: Sequence[int] = ()) -> dict[str, Any]:
    """items, episodes, infra failures, mean reward, pass@1 and pass@k for each k in `ks` (k >= 2)."""
    primary = [t for item in items for t in item.primary]
    scored = _scored(primary)
    figures: dict[str, Any] = {
        "items": len(items),
        "episodes": len(primary),
        "infra_failures": len(primary) - len(scored),
        "mean_reward": _mean([t.reward.score for t in scored]),
    }
    if any(item.greedy is not None for item in items):
        figures["pass@1"] = _mean([float(t.reward.passed) for t in _scored(i.greedy for i in items if i.greedy)])
    else:
        figures["pass@1"] = _sampled_pass_at_k(items, 1)
    for k in sorted({k for k in ks if k >= 2}):
        figures[f"pass@{k}"] = _sampled_pass_at_k(items, k)
    return figures


def item_pass_rates(items: Sequence[ItemEpisodes]) -> dict[str, float]:
    """Each item's pass@1 by task id: its greedy episode's outcome (0 or 1) when one ran, else the share of its
    scored samples that passed. An item with nothing scored (infrastructure failures only) is left out."""
    rates = {}
    for item in items:
        scored = _scored([item.greedy] if item.greedy is not None else item.samples)
        if scored:
            rates[item.task.id] = sum(float(t.reward.passed) for t in scored) / len(scored)
    return rates


def paired_difference(before: dict[str, float], after: dict[str, float]) -> dict[str, float | int]:
    """`after` minus `before` on the items both scored (per-item pass rates, e.g. `item_pass_rates` of two
    checkpoints on one held-out set), with its standard error. The items are paired, so the error is that of the
    mean per-item difference d_i, sqrt(var(d) / n): smaller than two independent pass rates' when most items keep
    their outcome. `better` and `worse` count the items whose rate rose and fell."""
    diffs = [after[key] - before[key] for key in sorted(before.keys() & after.keys())]
    n = len(diffs)
    mean = sum(diffs) / n if n else 0.0
    variance = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    return {"gain": mean, "standard_error": math.sqrt(variance / n) if n else 0.0, "items": n,
            "better": sum(d > 0 for d in diffs), "worse": sum(d < 0 for d in diffs)}


def pooled_difference(differences: Sequence[dict[str, Any]]) -> dict[str, float | int] | None:
    """The mean of `paired_difference`s over different item sets (suites, domains, seeds) and its standard error,
    sqrt(sum of their squared errors) / count: different items, independent. None when there is none."""
    if not differences:
        return None
    count = len(differences)
    return {"gain": sum(d["gain"] for d in differences) / count, "count": count,
            "standard_error": math.sqrt(sum(d["standard_error"] ** 2 for d in differences)) / count}


def _sampled_pass_at_k(items: Sequence[ItemEpisodes], k: int) -> float | None:
    values = []
    for item in items:
        scored = _scored(item.samples)
        if len(scored) >= k:
            values.append(pass_at_k(len(scored), sum(t.reward.passed for t in scored), k))
    return _mean(values)


def by_level(items: Sequence[ItemEpisodes], ks: Sequence[int] = ()) -> dict[str, dict[str, Any]]:
    """`outcome_metrics` per difficulty level (keys are the levels as strings, for JSON)."""
    levels: dict[int, list[ItemEpisodes]] = defaultdict(list)
    for item in items:
        levels[item.task.difficulty].append(item)
    return {str(level): outcome_metrics(levels[level], ks) for level in sorted(levels)}


def process_metrics(trajectories: Iterable[Trajectory]) -> dict[str, Any]:
    """How episodes went, over the scored ones.

    ``tokens_per_solved`` is every policy token spent divided by the episodes solved: the price of one
    solution, failures included. ``recovery_rate`` is the share solved among episodes with at least one failed
    step or failed tool call. ``seconds_per_episode`` is wall time, queueing for a batch included.
    """
    scored = _scored(trajectories)
    solved = sum(t.reward.passed for t in scored)
    calls = sum(t.tool_calls for t in scored)
    stumbled = [t for t in scored if t.failed_steps > 0 or t.tool_calls > t.tool_calls_ok]
    tokens = sum(t.policy_tokens for t in scored)
    return {
        "episodes": len(scored),
        "solved": solved,
        "avg_steps": _mean([t.steps for t in scored]),
        "tool_calls": calls,
        "tool_call_success": sum(t.tool_calls_ok for t in scored) / calls if calls else None,
        "tokens_per_episode": tokens / len(scored) if scored else None,
        "tokens_per_solved": tokens / solved if solved else None,
        "recovery_episodes": len(stumbled),
        "recovery_rate": _mean([float(t.reward.passed) for t in stumbled]),
        "truncated_rate": _mean([float(t.truncated) for t in scored]),
        "seconds_per_episode": _mean([t.wall_s for t in scored]),
    }


def failure_counts(trajectories: Iterable[Trajectory]) -> dict[str, int]:
    """Failed episodes per failure class (infrastructure classes included), in `FAILURE_CLASSES` order."""
    counts = Counter(failure_class(t) for t in trajectories if not t.reward.passed)
    return {name: counts[name] for name in FAILURE_CLASSES if counts.get(name)}


def failure_class(trajectory: Trajectory) -> str:
    """The class a failed episode is reported under (a failure a verifier left unlabelled is a wrong answer)."""
    failure = trajectory.reward.failure
    return FailureClass.WRONG_ANSWER.value if failure is FailureClass.NONE else failure.value


def safety_metrics(items: Sequence[ItemEpisodes]) -> dict[str, Any] | None:
    """Refusal accuracy (harmful items refused) and over-refusal rate (benign items refused), from the primary
    episodes of items whose task says ``metadata["should_refuse"]``; None when the suite has none."""
    harmful: list[Trajectory] = []
    benign: list[Trajectory] = []
    for item in items:
        if "should_refuse" not in item.task.metadata:
            continue
        target = harmful if item.task.metadata["should_refuse"] else benign
        target += _scored(item.primary)
    if not harmful and not benign:
        return None
    return {
        "harmful": len(harmful),
        "refusal_accuracy": _mean([float(bool(t.reward.details.get("refused"))) for t in harmful]),
        "benign": len(benign),
        "over_refusal_rate": _mean([float(bool(t.reward.details.get("refused"))) for t in benign]),
        "benign_accuracy": _mean([float(t.reward.passed) for t in benign]),
    }


def length_depth_metrics(items: Sequence[ItemEpisodes], bins: int = DEPTH_BINS) -> dict[str, Any] | None:
    """pass@1 by (length, depth bin) over the scored primary episodes of items whose task metadata gives
    ``length`` (tokens) and ``depth`` (a fraction); None when the suite has none.

    ``{"lengths": [1024, 2048], "depths": ["0-20%", ...], "cells": [[{"items", "passed", "pass@1"} | None]]}``
    with one row per length and one cell per depth bin (None where no item fell)."""
    outcomes: dict[tuple[int, int], list[bool]] = defaultdict(list)
    for item in items:
        meta = item.task.metadata
        if not isinstance(meta.get("length"), int) or not isinstance(meta.get("depth"), (int, float)):
            continue
        column = min(bins - 1, max(0, int(float(meta["depth"]) * bins)))
        outcomes[(meta["length"], column)] += [bool(t.reward.passed) for t in _scored(item.primary)]
    if not outcomes:
        return None
    lengths = sorted({length for length, _ in outcomes})
    step = 100 // bins
    cells = []
    for length in lengths:
        row = []
        for column in range(bins):
            passed = outcomes.get((length, column))
            row.append(None if passed is None else
                       {"items": len(passed), "passed": sum(passed), "pass@1": _mean([float(p) for p in passed])})
        cells.append(row)
    return {"lengths": lengths, "depths": [f"{c * step}-{(c + 1) * step}%" for c in range(bins)], "cells": cells}


@dataclass(frozen=True)
class SuiteScore:
    """One suite's pass@1 (over its scored episodes; None when none was scored) and its episode counts."""

    pass_rate: float | None
    episodes: int
    infra_failures: int

    @classmethod
    def of(cls, items: Sequence[ItemEpisodes]) -> SuiteScore:
        figures = outcome_metrics(items)
        return cls(figures["pass@1"], figures["episodes"], figures["infra_failures"])


def suite_metrics(items: Sequence[ItemEpisodes], ks: Sequence[int] = ()) -> dict[str, Any]:
    """Everything the results JSON keeps for one suite and checkpoint (examples aside)."""
    primary = [t for item in items for t in item.primary]
    figures = {
        "overall": outcome_metrics(items, ks),
        "levels": by_level(items, ks),
        "process": process_metrics(primary),
        "failures": failure_counts(primary),
    }
    safety = safety_metrics(items)
    if safety is not None:
        figures["safety"] = safety
    grid = length_depth_metrics(items)
    if grid is not None:
        figures["length_depth"] = grid
    return figures
