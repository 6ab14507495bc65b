"""The sandbox package's one error type: the user's setup is wrong (bubblewrap missing, bad limits ...).

A run that merely fails (the program crashed, timed out, or the jail could not start this time) is never raised:
it comes back as a `RunResult` with a status, so a training loop keeps going and retries ``infra_error``.
"""

from __future__ import annotations

from posttrain.types import PosttrainError


class SandboxError(PosttrainError):
    """Something the user must fix before sandboxed runs can work; the message names the fix."""
