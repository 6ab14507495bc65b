"""From an episode to its learning signal: its return (the verifier's outcome plus the costs and shaping a
recipe asks for), then its advantage (group-relative estimators, or per-token GAE with a critic).

**Returns.**

    return = outcome                                   (the verifier's score, in [0, 1])
           - step_cost  * (steps - 1)                  (agentic episodes: fewer steps is better)
           - token_cost * policy tokens                (shorter is better)
           + process_weight * process reward           (the environment's per-step judgement, if any)
           + learned                                   (the recipe's `reward_model:` weight x its score,
                                                        when one is configured: `rl.learned`)
           + overlong penalty                          (DAPO's soft penalty: 0 up to L - B tokens, then
                                                        linear down to -penalty at the limit L)

Every component is returned by name so the trainer logs them separately; what the model is trained on
is their sum. `overlong: mask` instead removes truncated episodes from the loss (see `rl.update`).

With the recipe's `rewards:` (functions of the user's own and verifiers, `posttrain.verify.rewards`) the outcome
is their weighted sum, judged in the episode; `with_rewards` puts the terms on every task the rollout function
gets, and `reward_metrics` reports each term as ``reward/<name>`` (its mean raw value over the scored episodes).

**Advantages** for outcome rewards (one scalar return per sampled sequence).

Sequences sampled for the same prompt form a group (`group_ids`). With r the rewards of a group of n:

    grpo        A_i = (r_i - mean(r)) / (std(r) + eps)      std: the unbiased sample std, as in the GRPO
                                                            paper's implementation; `scale=False` drops it
    dr_grpo     A_i = r_i - mean(r)                          (Dr. GRPO: no std, pair with `constant`
                                                            loss aggregation, no length normalisation)
    rloo        A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean(r))   (leave-one-out baseline)
    batch_norm  A_i = (r_i - mean(r)) / std over the whole batch of (r - group mean)   (REINFORCE++
                                                            with a group baseline; singleton groups use
                                                            the batch mean as their baseline)

A group whose rewards are all equal gets A = 0 for every member under every estimator: it carries no
signal (dynamic sampling in `posttrain.schedule` can drop such groups and refill the batch).

`gae_advantages` is the alternative with a learned critic (PPO, `algorithm.advantage: gae`): one advantage
per policy token. The policy tokens of an episode, in order, form one chain k = 0..K-1 — an agentic episode's
observation tokens are not steps of it: they are part of the transition from the last token of one turn to the
first of the next, with no reward, no value target and no discount of their own. The outcome reward R (the
episode's return) lands on the last policy token; V_k is the critic's value of the state before token k, and
V_K = 0 (the episode ends; a truncated one too: the verifier judged what was produced):

    delta_k = r_k + gamma V_{k+1} - V_k          r_k = R if k = K-1 else 0
    A_k     = sum_l (gamma lam)^l delta_{k+l}     (Schulman et al., 2016)
    G_k     = A_k + V_k                           the critic's regression target (the lambda-return)

`whiten` then standardises the advantages over every policy token of the batch.

`normalize_per_domain` rescales rewards before advantages so that domains with different reward scales
(a 0/1 exact match beside a fractional test pass rate) contribute comparably: within each domain of the
batch, r -> (r - mean_domain) / (std_domain + eps).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Literal, Sequence

import torch

from posttrain.config import RLRecipe, ReturnConfig
from posttrain.envs import episode_policy_tokens
from posttrain.rl.pipeline import RolloutFn
from posttrain.types import SamplingParams, Task, Trajectory
from posttrain.verify import check_terms, with_reward_terms

Estimator = Literal["grpo", "dr_grpo", "rloo", "batch_norm"]
EPS = 1e-6


def episode_return(trajectory: Trajectory, config: ReturnConfig, max_new_tokens: int,
                   learned: float | None = None) -> tuple[float, dict[str, float]]:
    components = {"outcome": float(trajectory.reward.score)}
    if learned is not None:
        components["learned"] = learned
    if config.step_cost:
        components["step_cost"] = -config.step_cost * max(0, trajectory.steps - 1)
    if config.token_cost:
        components["token_cost"] = -config.token_cost * episode_policy_tokens(trajectory)
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


def _groups(group_ids: Sequence[str]) -> dict[str, list[int]]:
    members: dict[str, list[int]] = defaultdict(list)
    for index, group in enumerate(group_ids):
        members[group].append(index)
    return members


def compute_advantages(
    rewards: Sequence[float],
    group_ids: Sequence[str],
    estimator: Estimator = "grpo",
    *,
    scale: bool = True,
) -> torch.Tensor:
    """One advantage per sequence, float64 (cast by the caller where needed)."""
    r = torch.as_tensor(list(rewards), dtype=torch.float64)
    if len(group_ids) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(group_ids)} group ids")
    advantages = torch.zeros_like(r)
    groups = _groups(group_ids)
    for members in groups.values():
        index = torch.tensor(members)
        values = r[index]
        n = len(members)
        centred = values - values.mean()
        if estimator == "grpo":
            std = values.std(unbiased=True) if n > 1 else torch.tensor(0.0, dtype=r.dtype)
            advantages[index] = centred / (std + EPS) if scale else centred
        elif estimator == "dr_grpo":
            advantages[index] = centred
        elif estimator == "rloo":
            advantages[index] = centred * n / (n - 1) if n > 1 else torch.zeros_like(values)
        elif estimator == "batch_norm":
            advantages[index] = centred if n > 1 else values - r.mean()
        else:
            raise ValueError(f"unknown advantage estimator {estimator!r}")
    if estimator == "batch_norm" and len(r) > 1:
        std = advantages.std(unbiased=True)
        advantages = advantages / (std + EPS) if scale else advantages
    return advantages


def normalize_per_domain(rewards: Sequence[float], domains: Sequence[str]) -> list[float]:
    """Z-score rewards within each domain of the batch (a domain with one value or no spread -> 0)."""
    r = torch.as_tensor(list(rewards), dtype=torch.float64)
    out = torch.zeros_like(r)
    for members in _groups(domains).values():
        index = torch.tensor(members)
        values = r[index]
        std = values.std(unbiased=True) if len(members) > 1 else torch.tensor(0.0, dtype=r.dtype)
        out[index] = (values - values.mean()) / (std + EPS) if float(std) > 0 else torch.zeros_like(values)
    return out.tolist()


def gae_advantages(returns: Sequence[float], values: Sequence[torch.Tensor], gamma: float, lam: float
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-token advantages and value targets of each episode (see the module docstring): `values[i]` holds
    the critic's value before each of episode i's policy tokens, in order; its return lands on the last."""
    advantages, targets = [], []
    for outcome, episode_values in zip(returns, values, strict=True):
        # Plain floats: a Python loop over a few hundred tokens beats indexing tensors element by element.
        value = episode_values.double().tolist()
        advantage = [0.0] * len(value)
        running, next_value, reward = 0.0, 0.0, float(outcome)
        for k in reversed(range(len(value))):
            running = reward + gamma * next_value - value[k] + gamma * lam * running
            advantage[k] = running
            next_value, reward = value[k], 0.0
        advantages.append(torch.tensor(advantage, dtype=torch.float32))
        targets.append(torch.tensor([a + v for a, v in zip(advantage, value)], dtype=torch.float32))
    return advantages, targets


def whiten(advantages: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """(A - mean) / (std + eps) over every token of the batch (fewer than two tokens: unchanged)."""
    flat = torch.cat(list(advantages)) if advantages else torch.zeros(0)
    if flat.numel() < 2:
        return list(advantages)
    mean, std = flat.mean(), flat.std(unbiased=True)
    return [(a - mean) / (std + EPS) for a in advantages]


# ---- the recipe's reward terms (`rewards:`) --------------------------------------------------------------


def reward_terms(recipe: RLRecipe) -> list[dict[str, Any]]:
    """The recipe's `rewards:` as the plain dicts a task carries (checked: functions import, verifiers exist)."""
    terms = []
    for term in recipe.rewards:
        entry: dict[str, Any] = {"name": term.label, "weight": term.weight}
        entry.update({"function": term.function, "timeout_s": term.timeout_s} if term.function
                     else {"verifier": term.verifier, "args": term.args})
        if term.binary:
            entry["binary"] = True
        terms.append(entry)
    check_terms(terms)
    return terms


def with_rewards(rollout: RolloutFn, recipe: RLRecipe) -> RolloutFn:
    """`rollout` judging every task by the recipe's reward terms (unchanged when it has none)."""
    terms = reward_terms(recipe)
    if not terms:
        return rollout

    def run(tasks: list[Task], sampling: SamplingParams) -> list[Trajectory]:
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
