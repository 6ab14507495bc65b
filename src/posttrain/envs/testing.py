"""`run_tests` for agentic tasks: run a project's ``test_*.py`` files in the sandbox and report to the model.

The sandbox has no pytest, so a small runner of ours (below) imports every ``test_*.py`` file and calls each
``test_*`` function, printing ``PASSED``/``FAILED`` lines and a summary. What it prints is an *observation* for
the model, never a reward: the code under test runs in the same process and could print anything. Rewards come
from the task's verifier, which compares outputs outside the sandbox.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.envs.base import ToolError
from posttrain.envs.sandboxing import run_in_sandbox

RUNNER_NAME = "_posttrain_run_tests.py"

RUNNER_SOURCE = r'''
import importlib.util, os, sys, traceback
sys.path.insert(0, os.getcwd())
sys.dont_write_bytecode = True
passed = failed = 0
paths = []
for root, dirs, files in os.walk("."):
    dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
    paths += [os.path.join(root, f)[2:] for f in sorted(files) if f.startswith("test_") and f.endswith(".py")]
for path in paths:
    try:
        spec = importlib.util.spec_from_file_location(path[:-3].replace("/", "."), path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except BaseException as error:
        failed += 1
        print(f"ERROR {path}: {type(error).__name__}: {error}")
        continue
    for name in sorted(n for n in vars(module) if n.startswith("test_") and callable(getattr(module, n))):
        try:
            getattr(module, name)()
            passed += 1
            print(f"PASSED {path}::{name}")
        except BaseException as error:
            failed += 1
            frame = traceback.extract_tb(error.__traceback__)[-1]
            detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            print(f"FAILED {path}::{name} - {detail} (line {frame.lineno}: {frame.line})")
if not paths:
    print("no test files found (test_*.py)")
print(f"{passed} passed, {failed} failed")
'''


@dataclass
class TestReport:
    status: str  # the sandbox's status: ok, runtime_error, timeout, ...
    text: str  # what the model sees


async def run_project_tests(files: dict[str, str], sandbox: Any, options: dict[str, Any]) -> TestReport:
    """Run the workspace's tests in `sandbox`; a timeout or crash is the model's `ToolError`."""
    timeout_s = float(options.get("test_timeout_s", 10.0))
    result = await run_in_sandbox(sandbox, RUNNER_NAME, files={**files, RUNNER_NAME: RUNNER_SOURCE},
                                  timeout_s=timeout_s)
    if result.status == "timeout":
        raise ToolError(f"the tests did not finish within {timeout_s:g} s")
    if result.status not in ("ok", "runtime_error"):
        raise ToolError(f"the tests could not complete ({result.status}): {result.stderr[-300:]}")
    text = result.stdout.strip()
    if result.status == "runtime_error" and result.stderr.strip():
        text += "\n" + result.stderr.strip()[-1000:]
    return TestReport(status=result.status, text=text)
