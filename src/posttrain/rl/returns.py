"""Episode returns: the verifier's outcome plus the costs and shaping a recipe asks for.

    return = outcome                                   (the verifier's score, in [0, 1])
           - step_cost  * (steps - 1)                  (agentic episodes: fewer steps is better)
           - token_cost * policy tokens                (shorter is better)
           + process_weight * process reward           (the environment's per-step judgement, if any)
           + learned                                   (the recipe's `reward_model:` weight x its score,
                                                        when one is configured: `rl.learned_reward`)
           + overlong penalty                          (DAPO's soft penalty: 0 up to L - B tokens, then
                                                        linear down to -penalty at the limit L)

Every component is returned by name so the trainer logs them separately; what the model is trained on
is their sum. `overlong: mask` instead removes truncated episodes from the loss (see `rl.step`).

With the recipe's `rewards:` (functions of the user's own and verifiers, `posttrain.verify.rewards`) the outcome
is their weighted sum, judged in the episode; `with_rewards` puts the terms on every task the rollout function
gets, and `reward_metrics` reports each term as ``reward/<name>`` (its mean raw value over the scored episodes).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

from posttrain.config.rl import ReturnConfig, RLRecipe
from posttrain.types import Task, Trajectory
from posttrain.verify.rewards import check_terms, with_reward_terms


def episode_return(trajectory: Trajectory, config: ReturnConfig, max_new_tokens: int,
                   learned: float | None = None) -> tuple[float, dict[str, float]]:
    components = {"outcome": float(trajectory.reward.score)}
    if learned is not None:
        components["learned"] = learned
    if config.step_cost:
        components["step_cost"] = -config.step_cost * max(0, trajectory.steps - 1)
    if config.token_cost:
        components["token_cost"] = -config.token_cost * trajectory.policy_tokens
    if config.process_weight:
        process = trajectory.reward.components.get("process", trajectory.metadata.get("process_reward", 0.0))
        components["process"] = config.process_weight * float(process)
    if config.overlong == "penalty":
        components["overlong"] = overlong_penalty(
            _longest_turn(trajectory), trajectory.truncated, max_new_tokens, config.overlong_buffer,
            config.overlong_penalty,
        )
    return sum(components.values()), components


def overlong_penalty(length: int, truncated: bool, limit: int, buffer: int, penalty: float) -> float:
    if truncated or length >= limit:
        return -penalty
    start = limit - buffer
    if buffer <= 0 or length <= start:
        return 0.0
    return -penalty * (length - start) / buffer


def _longest_turn(trajectory: Trajectory) -> int:
    longest, current = 0, 0
    for flag in trajectory.loss_mask:
        current = current + 1 if flag else 0
        longest = max(longest, current)
    return longest


def reward_terms(recipe: RLRecipe) -> list[dict[str, Any]]:
    """The recipe's `rewards:` as the plain dicts a task carries (checked: functions import, verifiers exist)."""
    terms = []
    for term in recipe.rewards:
        entry: dict[str, Any] = {"name": term.label, "weight": term.weight}
        entry.update({"function": term.function} if term.function else {"verifier": term.verifier,
                                                                        "args": term.args})
        terms.append(entry)
    check_terms(terms)
    return terms


RolloutFn = Callable[[list[Task], Any], list[Trajectory]]


def with_rewards(rollout: RolloutFn, recipe: RLRecipe) -> RolloutFn:
    """`rollout` judging every task by the recipe's reward terms (unchanged when it has none)."""
    terms = reward_terms(recipe)
    if not terms:
        return rollout

    def run(tasks: list[Task], sampling: Any) -> list[Trajectory]:
        return rollout([with_reward_terms(task, terms) for task in tasks], sampling)

    return run


def reward_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """``reward/<term>``: the mean raw value of each reward term over the episodes that were scored."""
    values: dict[str, list[float]] = defaultdict(list)
    for trajectory in trajectories:
        weights = trajectory.reward.details.get("weights")
        if trajectory.reward.is_infrastructure_failure or not isinstance(weights, dict):
            continue
        for name in weights:
            if name in trajectory.reward.components:
                values[name].append(float(trajectory.reward.components[name]))
    return {f"reward/{name}": sum(v) / len(v) for name, v in values.items() if v}
