"""What a group of episodes of one task is worth to the trainer: the one rule the producer (which drops or keeps
groups), the scheduler (which counts what reached the trainer) and the trainer (which zeroes advantages) share.

A group's *members* are its episodes that did not fail for infrastructure reasons (those are masked, never
scored 0). Its outcome is

* ``infra``: no member left (every episode was lost to the system);
* ``zero_spread``: all members' verifier scores are equal (one member included), so every group-relative
  advantage is 0 and the group carries no learning signal (DAPO's dynamic sampling filters these);
* ``signal``: the scores differ.

The spread is measured on the verifier score, not on the shaped return: costs per step or token alone do not
make a group worth a refill.
"""

from __future__ import annotations

from typing import Literal, Sequence

from posttrain.types import Trajectory

Outcome = Literal["infra", "zero_spread", "signal"]
DROPPED_KEY = "dropped"  # Trajectory.metadata key: why the producer left a group out of training


def split_groups(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Consecutive runs of one `group_id`, in order (`rollout_many` returns each group contiguous)."""
    groups: list[list[Trajectory]] = []
    for trajectory in trajectories:
        if groups and groups[-1][0].group_id == trajectory.group_id:
            groups[-1].append(trajectory)
        else:
            groups.append([trajectory])
    return groups


def scored_members(group: Sequence[Trajectory]) -> list[Trajectory]:
    return [t for t in group if not t.reward.is_infrastructure_failure]


def group_outcome(group: Sequence[Trajectory]) -> Outcome:
    members = scored_members(group)
    if not members:
        return "infra"
    first = members[0].reward.score
    return "signal" if any(t.reward.score != first for t in members[1:]) else "zero_spread"


def is_kept(outcome: Outcome, mode: str) -> bool:
    """Whether a group with `outcome` reaches the trainer under dynamic-sampling `mode` ("drop" / "keep")."""
    return outcome == "signal" or (outcome == "zero_spread" and mode == "keep")


def is_dropped(trajectory: Trajectory) -> bool:
    return DROPPED_KEY in trajectory.metadata
