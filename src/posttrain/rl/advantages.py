"""Advantage estimators for outcome rewards (one scalar reward per sampled sequence).

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

`normalize_per_domain` rescales rewards before advantages so that domains with different reward scales
(a 0/1 exact match beside a fractional test pass rate) contribute comparably: within each domain of the
batch, r -> (r - mean_domain) / (std_domain + eps).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Literal, Sequence

import torch

Estimator = Literal["grpo", "dr_grpo", "rloo", "batch_norm"]
EPS = 1e-6


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
