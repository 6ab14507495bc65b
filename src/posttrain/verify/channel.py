"""The one channel a jailed judge reports through: a single stdout line ``NONCE JSON``.

The nonce is drawn per run here, outside the jail, and only the judging process inside ever learns it (see
`_harness.py`). Anything else the jail printed - a fake result, a "PASSED" banner, a JSON lookalike - is
ignored; no line, or two lines, with the nonce means no result, which scores 0.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from posttrain.sandbox import RunResult


def new_nonce() -> str:
    return secrets.token_hex(16)


def runs_in_jail(sandbox: Any) -> bool:
    """Whether `sandbox` runs programs in bubblewrap jails - each its own PID namespace, where a judge may
    kill(-1) to stop everything the candidate left running. Outside one that would hit the whole machine."""
    return getattr(getattr(sandbox, "pool", None), "backend", "") == "bubblewrap"


def read_record(result: RunResult, nonce: str) -> dict[str, Any] | None:
    """The judge's record; None if it is missing, repeated or malformed."""
    prefix = (nonce + " ").encode()
    lines = [line for line in result.stdout_bytes.split(b"\n") if line.startswith(prefix)]
    if len(lines) != 1:
        return None
    try:
        record = json.loads(lines[0][len(prefix):])
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None
