"""The ``repo_tests`` verifier: hidden function cases run against the modules of an agent's final workspace.

    Task(..., verifier="repo_tests", verifier_args={"checks": [
        {"file": "shop/pricing.py", "function": "total", "cases": [{"args": [[1, 2]], "expected": 3}]}]})

Judged on the files in ``final_state["files"]`` (the tools env's workspace), never on what the agent said: each
check goes through the ``code`` verifier with the module as ``solution_file`` and the whole workspace shipped into
the jail, so the module's imports of its siblings resolve. Score 1 only when every case of every check passes.
Used by the ``repo_fix`` domain (`posttrain.tasks.repo_fix`); it lives here so that the verifier registry is
complete on ``import posttrain.verify``.
"""

from __future__ import annotations

from typing import Any

from posttrain.types import FailureClass, Reward
from posttrain.verify.code_tests import parse_tests, verify_code
from posttrain.verify.errors import VerifyError
from posttrain.verify.registry import verifier

# posttrain's own helper files in a workspace (the tools env's test runner, `_posttrain_run_tests.py`): not the
# agent's project, so never shipped as part of it.
HELPER_PREFIX = "_posttrain_"


def _check_repo_args(checks: Any = None, **_: Any) -> None:
    if not isinstance(checks, list) or not checks:
        raise VerifyError("verifier 'repo_tests': checks must be a non-empty list of {file, function, cases}")
    for check in checks:
        if not isinstance(check, dict) or not isinstance(check.get("file"), str):
            raise VerifyError("verifier 'repo_tests': each check needs a 'file' (the module's path)")
        parse_tests({"function": check.get("function"), "cases": check.get("cases")})


@verifier("repo_tests", check=_check_repo_args)
def verify_repo_tests(completion: str, checks: list[dict[str, Any]], *, timeout_s: float = 4.0,
                      final_state: dict[str, Any] | None = None) -> Reward:
    """1 if every hidden case of every check passes on the final workspace's files, else 0.

    Each check runs through the ``code`` verifier with the module as ``solution_file`` and the workspace shipped
    into the jail, so the module's imports of its siblings resolve. What the agent said is not read at all.
    """
    files = (final_state or {}).get("files")
    if not isinstance(files, dict):
        return Reward(0.0, False, FailureClass.FORMAT, details={"reason": "no_workspace_in_final_state"})
    state = {"files": {path: content for path, content in files.items() if not path.startswith(HELPER_PREFIX)}}
    results: dict[str, Any] = {}
    passed = 0
    for check in checks:
        tests = {"function": check["function"], "cases": check["cases"]}
        reward = verify_code("", tests, solution_file=check["file"], timeout_s=timeout_s, final_state=state)
        if reward.is_infrastructure_failure:
            return reward
        results[f"{check['file']}:{check['function']}"] = {"score": reward.score,
                                                          "reason": reward.details.get("reason")}
        passed += reward.passed
    details = {"checks": results, "checks_passed": passed, "checks_total": len(checks)}
    if passed == len(checks):
        return Reward(1.0, True, details=details)
    missing = any(check["file"] not in files for check in checks)
    return Reward(0.0, False, FailureClass.WRONG_ANSWER, details={**details, "missing_files": missing})
