"""The distributed room's errors: the user's to fix (placement, configuration), or a worker that is gone."""

from __future__ import annotations

from posttrain.types import PosttrainError


class DistributedError(PosttrainError):
    """A distributed run cannot start or go on (cluster unreachable, unsupported combination, a worker lost)."""


class PlacementError(DistributedError):
    """The cluster does not have the CPUs/GPUs the requested actors need; the message names the numbers."""


class TrainerRankError(DistributedError):
    """A trainer rank died: the run stops; `--resume` continues from the last checkpoint exactly."""
