"""What the RL loop records of a batch: what is trainable, per-domain metrics, episode records, events."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

from posttrain.config.rl import RLRecipe
from posttrain.rl.learned_reward import LEARNED_REWARD_KEY
from posttrain.rl.pipeline import RolloutBatch
from posttrain.schedule import DROPPED_KEY, is_dropped
from posttrain.types import FailureClass, Trajectory


def select_trainable(trajectories: Sequence[Trajectory], step: int, recipe: RLRecipe
                     ) -> tuple[list[Trajectory], dict[str, int]]:
    """Drop what must not be trained on: infrastructure failures (masked, never a 0 reward), groups the
    producer dropped (no reward spread), and, by recipe, trajectories older than `max_staleness` versions.
    Returns the rest and the counts."""
    counts = {"episodes": len(trajectories), "infra_masked": 0, "filtered": 0, "stale_dropped": 0, "stale_kept": 0}
    usable = []
    for trajectory in trajectories:
        if trajectory.reward.is_infrastructure_failure:
            counts["infra_masked"] += 1
            continue
        if is_dropped(trajectory):
            counts["filtered"] += 1
            continue
        if trajectory.policy_tokens == 0:
            continue
        if step - trajectory.min_policy_version > recipe.pipeline.max_staleness:
            if recipe.pipeline.stale == "drop":
                counts["stale_dropped"] += 1
                continue
            counts["stale_kept"] += 1  # the behaviour ratio (clipped) reweights it
        usable.append(trajectory)
    return usable, counts


def batch_schedule_metrics(batch: RolloutBatch) -> dict[str, float]:
    """The producer's snapshot of the sampler (curriculum, mix, counters) and its dynamic-sampling counts."""
    metrics = {f"dynamic/{k}": float(v) for k, v in batch.stats.get("dynamic", {}).items()}
    metrics.update({k: float(v) for k, v in batch.stats.get("schedule", {}).items()})
    return metrics


def batch_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    by_domain: dict[str, list[Trajectory]] = defaultdict(list)
    for trajectory in trajectories:
        if not trajectory.reward.is_infrastructure_failure:
            by_domain[trajectory.domain].append(trajectory)
    scored = [t for group in by_domain.values() for t in group]
    metrics: dict[str, float] = {}
    if scored:
        metrics["reward/mean"] = sum(t.reward.score for t in scored) / len(scored)
        metrics["reward/pass_rate"] = sum(t.reward.passed for t in scored) / len(scored)
        metrics["rollout/policy_tokens"] = sum(t.policy_tokens for t in scored) / len(scored)
        metrics["rollout/truncated"] = sum(t.truncated for t in scored) / len(scored)
        metrics["rollout/steps"] = sum(t.steps for t in scored) / len(scored)
        calls = sum(t.tool_calls for t in scored)
        if calls:
            metrics["rollout/tool_call_success"] = sum(t.tool_calls_ok for t in scored) / calls
    for domain, group in by_domain.items():
        metrics[f"reward/{domain}"] = sum(t.reward.score for t in group) / len(group)
        metrics[f"pass_rate/{domain}"] = sum(t.reward.passed for t in group) / len(group)
    failures: dict[str, int] = defaultdict(int)
    for trajectory in trajectories:
        if trajectory.reward.failure is not FailureClass.NONE:
            failures[trajectory.reward.failure.value] += 1
    metrics.update({f"failures/{k}": float(v) for k, v in failures.items()})
    return metrics


def episode_record(trajectory: Trajectory, step: int) -> dict[str, Any]:
    """What the data flywheel keeps of an episode: the transcript, the verdict, and where it came from (and, when
    the recipe has a learned reward component and the episode was trained on, the reward model's score)."""
    record = {
        "step": step,
        "task_id": trajectory.task_id,
        "domain": trajectory.domain,
        "difficulty": trajectory.difficulty,
        "group_id": trajectory.group_id,
        "passed": trajectory.reward.passed,
        "score": trajectory.reward.score,
        "failure": trajectory.reward.failure.value,
        "details": trajectory.reward.details,
        "messages": trajectory.messages,
        "policy_version": trajectory.min_policy_version,
        "dropped": trajectory.metadata.get(DROPPED_KEY),  # why the group did not reach the trainer, if it did not
    }
    if LEARNED_REWARD_KEY in trajectory.metadata:
        record[LEARNED_REWARD_KEY] = trajectory.metadata[LEARNED_REWARD_KEY]
    return record


def describe_event(event: dict[str, Any]) -> str:
    kind, step = event["kind"], event["step"]
    if kind == "regression":
        return (f"step {step}: guard: suite '{event['suite']}' fell to {event['value']:.3f} (best {event['best']:.3f} "
                f"at step {event['best_step']}); action: {', '.join(event['actions'])}")
    if kind == "recovered":
        return f"step {step}: guard: suite '{event['suite']}' recovered to {event['value']:.3f}"
    if kind == "rollback":
        return (f"step {step}: rolled back to the checkpoint of step {event['to_step']}, learning rate now "
                f"x{event['lr_scale']:g} (rollback {event['rollbacks']})")
    if kind == "lr_decrease":
        return f"step {step}: no good checkpoint to roll back to; learning rate now x{event['lr_scale']:g}"
    return f"step {step}: alarm {kind}: {event['metric']} = {event['value']:.4g} (threshold {event['threshold']:.4g})"
