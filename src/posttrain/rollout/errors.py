"""The rollout room's error type: a request, sampling setting or weight update the engine cannot honour."""

from __future__ import annotations

from posttrain.types import PosttrainError


class RolloutError(PosttrainError):
    """A bad request, sampling parameter, engine option or state dict; the message says which and why."""
