"""Running tools' programs in `posttrain.sandbox`, with its infrastructure failures kept apart from the model's.

`run_in_sandbox` returns the sandbox's `RunResult` for the model's outcomes (ok, runtime_error, timeout, oom,
output_limit) and raises `ToolInfraError` for ``infra_error``: a jail that could not start is never the model's
failed tool call. Without a sandbox given, one default `Sandbox` (on the shared pool) is made on first use.
"""

from __future__ import annotations

from posttrain.envs.base import ToolInfraError
from posttrain.sandbox import RunResult, Sandbox

_default_sandbox: Sandbox | None = None


def default_sandbox() -> Sandbox:
    global _default_sandbox
    if _default_sandbox is None:
        _default_sandbox = Sandbox()
    return _default_sandbox


async def run_in_sandbox(sandbox: Sandbox | None, script: str, files: dict[str, str], timeout_s: float) -> RunResult:
    """Run the Python file `script` (one of `files`) in a fresh jail, within `timeout_s` of wall time."""
    box = sandbox if sandbox is not None else default_sandbox()
    limits = box.limits.replace(timeout_s=timeout_s, cpu_s=timeout_s)
    try:
        result = await box.arun([box.jail.python, "-B", "-s", script], files=files, limits=limits)
    except Exception as error:  # the sandbox itself failed (bad setup, pool closed): not the model's doing
        raise ToolInfraError(f"sandbox: {type(error).__name__}: {error}") from error
    if result.is_infra_error:
        raise ToolInfraError(f"sandbox infra_error: {result.error[-300:]}")
    return result



