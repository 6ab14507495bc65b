"""Code rewards: run the candidate against unit tests in the sandbox; reward = passed / total.

Three test shapes, all accepted by `verify_code`:
* stdin/stdout cases ``[{"stdin": "...", "stdout": "..."}]`` - the program runs once per case; its stdout is
  compared here with the expected text (trailing whitespace per line and trailing blank lines ignored);
* function cases ``{"function": "name", "cases": [{"args": [...], "kwargs": {...}, "expected": ...}]}`` - the
  function's return value comes back as JSON and is compared here with type-strict equality (``True != 1``,
  ``1 != 1.0``; a tuple equals the list JSON would make of it; floats equal within ``float_tolerance``);
* assert-style test source (a string) - the weaker scheme: the test statements run in the jail in a process
  separate from the solution (which it reaches through proxies), so the expected values are inside the jail;
  such rewards say ``"weaker_scheme": true`` in details.
For the first two, only the inputs enter the sandbox: expected outputs never do.
Each case may run for ``timeout_s``; once one has timed out, the cases after it share ``after_timeout_s``
seconds in all and fail unrun once that is spent (``"skipped: time budget spent"`` in details), so a program that
loops forever costs one judgement about ``timeout_s + after_timeout_s``, not ``timeout_s`` per case. Such a
timeout is the program's failure and is scored (``FailureClass.TIMEOUT`` when nothing passed).
Nothing the program prints, no exit code and no in-process assert is trusted; the harness (`_harness.py`) reports over a nonce-tagged line
and anything else is ignored. No code block, a syntax error or a crash at import scores 0. An ``infra_error``
of the sandbox is retried, then reported as ``FailureClass.SANDBOX`` (never a 0 to learn from).

From ``final_state`` (agentic tasks) the verifier reads ``files`` (the workspace, shipped into the jail) and,
with ``solution_file``, takes the program from that file instead of the completion.
"""

from __future__ import annotations

import ast
import builtins
import functools
import json
import math
import os
import secrets
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

from posttrain.sandbox import Limits, RunResult, Sandbox, SandboxError, check_file_name, file_conflicts
from posttrain.types import FailureClass, Reward
from posttrain.verify import _harness
from posttrain.verify.channel import new_nonce, read_record, runs_in_jail
from posttrain.verify.completion import code_block, strip_reasoning
from posttrain.verify.errors import VerifyError
from posttrain.verify.memo import judged_once
from posttrain.verify.registry import verifier

_HARNESS_SOURCE = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_harness.py")).read()


def _harness_bytecode(source: str) -> bytes:
    """The harness as a ``.pyc`` for this interpreter's bytecode version (an unchecked hash-based header, PEP 552):
    the jail's Python runs it as its script without compiling 600 lines first (~9 ms of a ~50 ms start here).
    Used only where the pool's self-test ran it and got the right verdict; the source otherwise."""
    import importlib.util
    import marshal

    code = compile(source, "_harness.py", "exec", dont_inherit=True)
    return (importlib.util.MAGIC_NUMBER + (1).to_bytes(4, "little") + importlib.util.source_hash(source.encode())
            + marshal.dumps(code))


_HARNESS_BYTECODE = _harness_bytecode(_HARNESS_SOURCE)
_START_S = 5.0  # jail + interpreter + harness start-up, within the jail's wall-clock budget
# Once a case of a sample has timed out, the cases after it share this many seconds: enough for the other cases
# of a program with one slow path (a fresh worker re-imports the solution in ~20 ms), far less than a full
# timeout each for a program that loops on every input.
AFTER_TIMEOUT_S = 1.0


@dataclass
class TestSpec:
    mode: str  # "function" | "stdio" | "assert"
    cases: list[dict[str, Any]] = field(default_factory=list)
    function: str = ""
    source: str = ""
    remote_names: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.cases) if self.mode != "assert" else _count_assert_tests(self.source)


def _count_assert_tests(source: str) -> int:
    module = ast.parse(source)
    return sum(isinstance(n, ast.Assert) or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Call))
               for n in module.body)


def _free_names(source: str) -> list[str]:
    """Names the test source reads but never binds: the solution's functions (reached through proxies)."""
    tree = ast.parse(source)
    bound, loaded = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return sorted(loaded - bound - set(dir(builtins)))


def parse_tests(tests: Any) -> TestSpec:
    """Check a test spec's shape; VerifyError says what is wrong and what the three shapes look like."""
    shapes = ('stdin/stdout cases [{"stdin": str, "stdout": str}], function cases {"function": name, "cases": '
              '[{"args": [...], "kwargs": {...}, "expected": ...}]}, or assert-style test source (a string)')
    if isinstance(tests, str):
        try:
            spec = TestSpec("assert", source=tests, remote_names=_free_names(tests))
        except SyntaxError as error:
            raise VerifyError(f"verifier 'code': the assert-style test source does not parse: {error}") from None
        if spec.total == 0:
            raise VerifyError("verifier 'code': the assert-style test source has no top-level assert or call")
        return spec
    if isinstance(tests, list):
        if not tests or not all(isinstance(c, dict) and isinstance(c.get("stdin"), str)
                                and isinstance(c.get("stdout"), str) for c in tests):
            raise VerifyError(f"verifier 'code': a list of tests must be stdin/stdout cases; expected {shapes}")
        return TestSpec("stdio", cases=[{"stdin": c["stdin"], "stdout": c["stdout"]} for c in tests])
    if isinstance(tests, dict) and "function" in tests:
        name, cases = tests.get("function"), tests.get("cases")
        if not isinstance(name, str) or not name.isidentifier():
            raise VerifyError(f"verifier 'code': function must be a Python identifier, got {name!r}")
        if not isinstance(cases, list) or not cases:
            raise VerifyError("verifier 'code': function tests need a non-empty list of cases")
        for index, case in enumerate(cases):
            if not isinstance(case, dict) or "expected" not in case:
                raise VerifyError(f"verifier 'code': case {index} must be a dict with 'expected'")
            if not isinstance(case.get("args", []), list) or not isinstance(case.get("kwargs", {}), dict):
                raise VerifyError(f"verifier 'code': case {index}: args must be a list and kwargs a dict")
            try:
                json.dumps([case.get("args", []), case.get("kwargs", {}), case["expected"]])
            except (TypeError, ValueError) as error:
                raise VerifyError(f"verifier 'code': case {index} is not JSON data: {error}") from None
        return TestSpec("function", cases=cases, function=name)
    raise VerifyError(f"verifier 'code': unknown test shape {type(tests).__name__}; expected {shapes}")


def _check_code_args(tests: Any = None, limits: Any = None, timeout_s: float = 4.0,
                     after_timeout_s: float = AFTER_TIMEOUT_S, **_: Any) -> None:
    _check_times(timeout_s, after_timeout_s)
    _run_limits(parse_tests(tests), timeout_s, limits)


def _check_times(timeout_s: Any, after_timeout_s: Any) -> None:
    for name, value, zero_ok in (("timeout_s", timeout_s, False), ("after_timeout_s", after_timeout_s, True)):
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or value < 0 or (value == 0 and not zero_ok):
            bound = ">= 0" if zero_ok else "> 0"
            raise VerifyError(f"verifier 'code': {name} must be a finite number of seconds {bound}, got {value!r}")


def strict_equal(got: Any, expected: Any, float_tolerance: float = 1e-9) -> bool:
    """Equality that respects types: bool is not int, int is not float; a tuple compares as a list."""
    if isinstance(got, tuple):
        got = list(got)
    if isinstance(expected, tuple):
        expected = list(expected)
    if type(got) is not type(expected):
        return False
    if isinstance(got, float):
        if math.isnan(got) or math.isnan(expected):
            return False
        return got == expected or math.isclose(got, expected, rel_tol=float_tolerance, abs_tol=float_tolerance)
    if isinstance(got, list):
        return len(got) == len(expected) and all(strict_equal(g, e, float_tolerance) for g, e in zip(got, expected))
    if isinstance(got, dict):
        return got.keys() == expected.keys() and all(strict_equal(got[k], expected[k], float_tolerance) for k in got)
    if isinstance(got, (set, frozenset)):
        return got == expected
    return bool(got == expected)


def normalize_stdout(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n")).rstrip("\n")


def _source(completion: str, final_state: dict[str, Any] | None, solution_file: str | None) -> str | None:
    if solution_file:
        files = (final_state or {}).get("files") or {}
        content = files.get(solution_file)
        return content if isinstance(content, str) else None
    block = code_block(completion)
    if block is not None:
        return block
    text = strip_reasoning(completion).strip()
    return text if text and ("def " in text or "import " in text or "print(" in text) else None


def _case_passed(spec: TestSpec, case: dict[str, Any], outcome: Any, float_tolerance: float) -> bool:
    if not isinstance(outcome, dict) or outcome.get("ok") is not True:
        return False
    if spec.mode == "assert":
        return True
    if spec.mode == "stdio":
        stdout = outcome.get("stdout")
        return isinstance(stdout, str) and normalize_stdout(stdout) == normalize_stdout(case["stdout"])
    try:
        value = _harness.decode(outcome.get("value"))
    except (ValueError, TypeError, RecursionError):
        return False
    return strict_equal(value, case["expected"], float_tolerance)


def _run_limits(spec: TestSpec, timeout_s: float, limits: Limits | dict[str, Any] | None) -> Limits:
    """The jail's limits: a wall-clock budget for every case, overridable per task (a `Limits`, or a dict of
    limit names to values as a task spec in YAML would give)."""
    if isinstance(limits, Limits):
        return limits
    budget = _START_S + spec.total * (timeout_s + 1.0)
    default = Limits(timeout_s=budget, cpu_s=budget, memory_mb=512, processes=64, output_bytes=4 << 20)
    try:
        return default.replace(**(limits or {}))
    except SandboxError as error:
        raise VerifyError(f"verifier 'code': limits: {error}") from None


def _judge(box: Any, spec: TestSpec, source: str | bytes, timeout_s: float, workspace: dict[str, Any], limits: Limits,
           infra_retries: int, after_timeout_s: float = AFTER_TIMEOUT_S, bytecode: bool | None = None
           ) -> tuple[RunResult, dict[str, Any] | None, int]:
    """One jail running the harness on `source`: (the run, the harness's record or None, infra retries used).
    Only the inputs go in; the nonce is new for every run. The harness goes in as bytecode where the pool's
    self-test proved its Python runs it (`bytecode` None: as that test found), else as source."""
    nonce = new_nonce()
    config_name = f".config-{secrets.token_hex(8)}"
    config = {"mode": spec.mode, "nonce": nonce, "timeout_s": timeout_s, "after_timeout_s": after_timeout_s,
              "function": spec.function,
              "cases": [{"args": c.get("args", []), "kwargs": c.get("kwargs", {})} if spec.mode == "function"
                        else {"stdin": c["stdin"]} for c in spec.cases],
              "source": spec.source, "remote_names": spec.remote_names, "jailed": runs_in_jail(box)}
    if bytecode is None:
        pool = getattr(box, "pool", None)
        bytecode = pool is not None and _runs_bytecode.get(pool, False)
    harness_file, harness = ("_harness.pyc", _HARNESS_BYTECODE) if bytecode else ("_harness.py", _HARNESS_SOURCE)
    files = {**workspace, "solution.py": source, harness_file: harness, config_name: json.dumps(config)}
    retries = 0
    while True:
        result = box.run([box.jail.python, "-B", "-s", harness_file, config_name], files=files, limits=limits)
        if not result.is_infra_error or retries >= infra_retries:
            return result, read_record(result, nonce), retries
        retries += 1


# The verifier's own files in the jail's working directory: a workspace file under one of these names is replaced.
_OWN_FILES = ("solution.py", "_harness.py", "_harness.pyc")


def _workspace(final_state: dict[str, Any] | None) -> tuple[dict[str, bytes], list[str]]:
    """The workspace files (``final_state["files"]``) that go into the jail beside the verifier's own, as bytes,
    and the names left out: a name the sandbox refuses (absolute, ``..``, too long, not UTF-8), text that is not
    UTF-8, a name under the verifier's own files, one that another file needs as its directory. An agent's final
    state can hold any of these (an external environment's above all); shipped as is, the jail could not start,
    and a judgement that never runs is an infrastructure failure, masked instead of scored, which a policy could
    learn to provoke. Left out, the program is judged on the rest, as if it had never written them."""
    files: dict[str, bytes] = {}
    dropped = []
    for name, content in ((final_state or {}).get("files") or {}).items():
        if not isinstance(content, (str, bytes)):
            continue
        try:
            normal = check_file_name(name)
            content = content.encode("utf-8", errors="surrogateescape") if isinstance(content, str) else content
        except (SandboxError, UnicodeEncodeError):
            dropped.append(str(name).encode("utf-8", errors="backslashreplace").decode())
            continue
        if normal.split("/")[0] in _OWN_FILES:
            if normal != "solution.py":  # the program judged is written there in any case
                dropped.append(name)
            continue
        files[normal] = content
    for _, under in file_conflicts(files):
        if files.pop(under, None) is not None:
            dropped.append(under)
    return files, sorted(dropped)


# A pool's self-test verdict on the harness as bytecode (True: its jail's Python judges right with it); a pool
# is in here once its self-test has passed.
_runs_bytecode: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SELF_TEST = TestSpec("function", cases=[{"args": [2, 3], "expected": 5}], function="add")
_SELF_TEST_SOURCE = "def add(a, b):\n    return a + b\n"


def _self_test(box: Any, run_limits: Limits) -> None:
    """Once per pool: the harness must judge a known-good program correctly in this jail (its Python may be too
    old, a library missing ...). Without this, a harness that cannot run would score every program 0, silently.
    Then the same with the harness as bytecode: kept only if that judges it right too (the jail's Python may be
    another version, whose bytecode differs), so bytecode can never score a program 0 that the source would not."""
    pool = getattr(box, "pool", None)
    if pool is None or pool in _runs_bytecode:
        return
    result, record, _ = _judge(box, _SELF_TEST, _SELF_TEST_SOURCE, 2.0, {}, run_limits, 2, bytecode=False)
    if result.is_infra_error:
        return  # the sandbox's own trouble, reported per run; try again next time
    if not _judged_right(record):
        raise VerifyError(f"the code verifier's harness does not work in this sandbox (interpreter "
                          f"{box.jail.python!r}, needs Python >= 3.9): status {result.status}, "
                          f"stderr: {result.stderr[-400:]!r}")
    result, record, _ = _judge(box, _SELF_TEST, _SELF_TEST_SOURCE, 2.0, {}, run_limits, 2, bytecode=True)
    _runs_bytecode[pool] = not result.is_infra_error and _judged_right(record)


def _judged_right(record: dict[str, Any] | None) -> bool:
    outcomes = (record or {}).get("cases") or [None]
    return bool(record) and _case_passed(_SELF_TEST, _SELF_TEST.cases[0], outcomes[0], 0.0)


@verifier("code", check=_check_code_args)
def verify_code(completion: str, tests: Any, *, timeout_s: float = 4.0, after_timeout_s: float = AFTER_TIMEOUT_S,
                float_tolerance: float = 1e-9, solution_file: str | None = None,
                limits: Limits | dict[str, Any] | None = None, sandbox: Sandbox | None = None,
                infra_retries: int = 2, final_state: dict[str, Any] | None = None, reuse: bool = True) -> Reward:
    """Run `tests` (any of the three shapes) against the program in `completion`; see the module doc.
    `timeout_s` bounds each case; after a first timeout the remaining cases share `after_timeout_s`. With
    `reuse`, a judgement identical to one running or made already in this sandbox pool is not run again
    (`posttrain.verify.memo`)."""
    _check_times(timeout_s, after_timeout_s)
    spec = parse_tests(tests)
    scheme = _scheme(spec)
    source = _source(completion, final_state, solution_file)
    if source is None:
        return Reward(0.0, False, FailureClass.FORMAT, details={"reason": "no_code", **scheme})
    run_limits = _run_limits(spec, timeout_s, limits)
    box = sandbox or Sandbox()  # the shared default pool
    _self_test(box, run_limits)
    try:
        source = source.encode("utf-8", errors="surrogateescape")  # as the sandbox writes text
    except UnicodeEncodeError:  # a lone surrogate (an agent's file written through a JSON escape): no program
        return Reward(0.0, False, FailureClass.WRONG_ANSWER, details={"reason": "not_utf8", **scheme})
    files, dropped = _workspace(final_state)
    size = sum(len(content) for content in files.values())
    if size + len(source) + len(_HARNESS_SOURCE) > run_limits.workdir_mb << 20:
        # as a program that outgrows its memory limit: the agent's doing, scored (the jail would refuse to start)
        return Reward(0.0, False, FailureClass.WRONG_ANSWER,
                      details={"reason": "workspace_too_large", "bytes": size, "workdir_mb": run_limits.workdir_mb,
                               **scheme})
    judge = functools.partial(_score, box, spec, source, timeout_s, files, dropped, run_limits, infra_retries,
                              after_timeout_s, float_tolerance)
    return judged_once(box, reuse, judge, asdict(spec), source, sorted(files.items()), dropped, repr(run_limits),
                       timeout_s, after_timeout_s, float_tolerance)


def _scheme(spec: TestSpec) -> dict[str, Any]:
    return {"scheme": spec.mode, "weaker_scheme": spec.mode == "assert", "total": spec.total}


def _score(box: Any, spec: TestSpec, source: bytes, timeout_s: float, files: dict[str, bytes], dropped: list[str],
           run_limits: Limits, infra_retries: int, after_timeout_s: float, float_tolerance: float) -> Reward:
    """One judgement in the jail, scored; the scheme's figures and the run's in details."""
    scheme = _scheme(spec)
    result, record, retries = _judge(box, spec, source, timeout_s, files, run_limits, infra_retries, after_timeout_s)
    run = {"status": str(result.status), "infra_retries": retries, "duration_s": round(result.duration_s, 3),
           **({"dropped_files": dropped} if dropped else {})}
    if result.is_infra_error:
        return Reward(0.0, False, FailureClass.SANDBOX, details={"reason": "sandbox_failure",
                                                                  "error": result.error[-500:], **scheme, **run})
    if record is None:
        failure = FailureClass.TIMEOUT if result.status == "timeout" else FailureClass.WRONG_ANSWER
        return Reward(0.0, False, failure, details={"reason": "no_result", **scheme, **run})
    if not record.get("compiled"):
        return Reward(0.0, False, FailureClass.WRONG_ANSWER,
                      details={"reason": "compile_error", "error": str(record.get("error"))[:300], **scheme, **run})
    outcomes = record.get("cases")
    if not isinstance(outcomes, list):
        outcomes = []
    verdicts = [_case_passed(spec, case, outcome, float_tolerance)
                for case, outcome in zip(spec.cases if spec.mode != "assert" else range(spec.total), outcomes)]
    verdicts += [False] * (spec.total - len(verdicts))
    passed = sum(verdicts)
    score = passed / spec.total
    timeouts = sum(1 for o in outcomes if isinstance(o, dict) and o.get("timeout"))
    details = {**scheme, **run, "passed": passed, "cases": [
        "pass" if ok else _why(o) for ok, o in zip(verdicts, outcomes + [None] * (spec.total - len(outcomes)))]}
    if record.get("import_error"):
        details["import_error"] = str(record["import_error"])[:300]
    if passed == spec.total:
        return Reward(1.0, True, FailureClass.NONE, details=details)
    failure = FailureClass.TIMEOUT if timeouts and not passed else FailureClass.WRONG_ANSWER
    return Reward(score, False, failure, details=details)


def _why(outcome: Any) -> str:
    if not isinstance(outcome, dict):
        return "no result"
    if outcome.get("skipped"):
        return "skipped: time budget spent"
    if outcome.get("timeout"):
        return "timeout"
    if outcome.get("ok"):
        return "wrong output"
    return str(outcome.get("error", "error"))[:200]
