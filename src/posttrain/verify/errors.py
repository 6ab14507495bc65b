"""The verify package's one error type: a task's verifier spec is wrong (unknown name, malformed tests ...).

A bad *completion* is never an error: it scores 0 with a failure class. A `VerifyError` is the task author's to
fix, and is raised as early as possible (`check_task` at task construction, `get_verifier` at lookup).
"""

from __future__ import annotations

from posttrain.types import PosttrainError


class VerifyError(PosttrainError):
    """A verifier spec that cannot work; the message names the verifier, the argument and the fix."""
