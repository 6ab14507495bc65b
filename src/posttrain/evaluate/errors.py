"""The evaluation room's error for the user's mistakes (a missing checkpoint, a bad suite, an unreadable file)."""

from __future__ import annotations

from posttrain.types import PosttrainError


class EvalError(PosttrainError):
    """An evaluation recipe or its inputs are wrong: the message says which, where, and how to fix it."""
