"""Code rewards on real jails: the three test shapes, partial credit, type-strict comparison, what never enters
the sandbox, infra failures that are not scores, and agentic final states."""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest

from posttrain.sandbox import JailOptions, Limits, RunResult, RunStatus, Sandbox, SandboxPool, UnsafeSandboxWarning
from posttrain.types import FailureClass, Trajectory, Reward
from posttrain.verify import VerifyError, normalize_stdout, parse_tests, strict_equal, verify_code
from posttrain.verify._harness import decode, encode

pytestmark = pytest.mark.bwrap

ADD = {"function": "add", "cases": [{"args": [1, 2], "expected": 3}, {"args": [2, 2], "expected": 4},
                                    {"args": [5, 5], "expected": 10}, {"args": [0, 7], "expected": 7}]}


def fenced(source: str) -> str:
    return f"Here you go:\n```python\n{source}\n```\n"


def test_function_cases_partial_credit_is_passed_over_total():
    reward = verify_code(fenced("def add(a, b):\n    return a + b if a < 5 else 0"), ADD)
    assert reward.score == 0.75 and not reward.passed and reward.failure == FailureClass.WRONG_ANSWER
    assert reward.details["cases"] == ["pass", "pass", "wrong output", "pass"]
    assert reward.details["scheme"] == "function" and reward.details["weaker_scheme"] is False


def test_type_strict_equality():
    assert strict_equal([1, (2, 3)], [1, [2, 3]]) and strict_equal(0.1 + 0.2, 0.3)
    assert not strict_equal(True, 1) and not strict_equal(1, 1.0) and not strict_equal("1", 1)
    assert not strict_equal({"a": 1}, {"a": True}) and not strict_equal(float("nan"), float("nan"))
    reward = verify_code(fenced("def add(a, b):\n    return float(a + b)"), ADD)
    assert reward.score == 0.0  # 3.0 is not 3


def test_values_cross_the_boundary_as_plain_builtins_only():
    value = {"k": (1, [2.5, None]), 3: {frozenset({1}), b"x"}, "big": 1 << 80, "nan": float("nan")}
    back = decode(json.loads(json.dumps(encode(value))))
    assert back["k"] == (1, [2.5, None]) and back[3] == {frozenset({1}), b"x"} and back["big"] == 1 << 80
    assert decode(encode(b"\x00\xffA")) == b"\x00\xffA"
    for bad in ({"$eval": "1"}, {"$dict": [[[1], 2]]}, {"$tuple": 5}, {"a": 1, "b": 2},
                {"$bytes": "00 ff"}, {"$bytes": "00FF"}, {"$bytes": "0"}):  # bytes: one spelling only
        with pytest.raises((ValueError, TypeError)):
            decode(bad)

    class Sneaky(int):
        pass

    with pytest.raises(TypeError):
        encode(Sneaky(3))


def test_stdio_cases_compare_normalized_stdout():
    tests = [{"stdin": "2 3\n", "stdout": "5\n"}, {"stdin": "10 -1\n", "stdout": "9"}]
    assert verify_code(fenced("a, b = map(int, input().split())\nprint(a + b, ' ')"), tests).score == 1.0
    assert verify_code(fenced("print(5)"), tests).score == 0.5
    assert normalize_stdout("a  \r\nb\n\n") == "a\nb"


def test_assert_style_tests_are_the_weaker_scheme():
    tests = "assert add(1, 2) == 3\nassert add(2, 2) == 4\nx = add(0, 0)\nassert x == 0\n"
    reward = verify_code(fenced("def add(a, b):\n    return a + b"), tests)
    assert reward.passed and reward.details["weaker_scheme"] is True and reward.details["total"] == 3
    assert verify_code(fenced("def add(a, b):\n    return 4"), tests).score == pytest.approx(1 / 3)


def test_expected_outputs_never_enter_the_sandbox():
    seen: list = []

    class Recording:
        jail = Sandbox().jail

        def run(self, cmd, **options):
            seen.append(options["files"])
            return Sandbox().run(cmd, **options)

    secret = {"function": "f", "cases": [{"args": [1], "expected": "EXPECTED-7f3a"}]}
    verify_code(fenced("def f(x):\n    return x"), secret, sandbox=Recording())
    io_secret = [{"stdin": "1\n", "stdout": "EXPECTED-9c1d\n"}]
    verify_code(fenced("print(input())"), io_secret, sandbox=Recording())
    shipped = json.dumps([{k: v.decode() if isinstance(v, bytes) else v for k, v in f.items()} for f in seen])
    assert "EXPECTED-7f3a" not in shipped and "EXPECTED-9c1d" not in shipped


def test_no_code_compile_error_and_crash_at_import_score_zero():
    assert verify_code("I would just add them.", ADD).details["reason"] == "no_code"
    assert verify_code(fenced("def add(a, b) return a"), ADD).details["reason"] == "compile_error"
    crashed = verify_code(fenced("def add(a, b):\n    return a + b\n1 / 0"), ADD)
    assert crashed.score == 0 and "ZeroDivisionError" in crashed.details["import_error"]


def test_one_slow_case_does_not_sink_the_others():
    source = "import time\ndef add(a, b):\n    if a == 5:\n        time.sleep(30)\n    return a + b"
    reward = verify_code(fenced(source), ADD, timeout_s=0.5)
    assert reward.score == 0.75 and reward.details["cases"][2] == "timeout"


FIVE = {"function": "add", "cases": [{"args": [i, 1], "expected": i + 1} for i in range(5)]}


def test_a_program_that_loops_forever_costs_one_timeout_plus_the_shared_budget():
    """5 cases x 2 s would be 10 s; after the first timeout the other four share 0.5 s, then fail unrun."""
    started = time.monotonic()
    reward = verify_code(fenced("def add(a, b):\n    while True:\n        pass"), FIVE, timeout_s=2.0,
                         after_timeout_s=0.5)
    elapsed = time.monotonic() - started
    assert reward.score == 0 and reward.failure == FailureClass.TIMEOUT and not reward.is_infrastructure_failure
    assert reward.details["cases"][0] == "timeout" and "skipped: time budget spent" in reward.details["cases"]
    assert elapsed < 2.0 + 0.5 + 2.5, elapsed  # the jail's start and the harness's own work on top


@pytest.mark.parametrize("tests", [
    [{"stdin": f"{i}\n", "stdout": f"{i}\n"} for i in range(5)],
    "\n".join(f"assert echo({i}) == {i}" for i in range(5)),
])
def test_the_bound_holds_for_stdio_and_assert_tests(tests):
    source = "import time\ndef echo(x):\n    time.sleep(60)\nif __name__ == '__main__':\n    echo(input())"
    started = time.monotonic()
    reward = verify_code(fenced(source), tests, timeout_s=1.5, after_timeout_s=0.3)
    assert reward.score == 0 and reward.failure == FailureClass.TIMEOUT
    assert time.monotonic() - started < 1.5 + 0.3 + 2.5
    assert reward.details["cases"][0] == "timeout" and reward.details["cases"][-1] == "skipped: time budget spent"


def test_an_honest_slow_program_still_passes():
    """Every case takes most of its timeout: nothing times out, so the shared budget never starts."""
    source = "import time\ndef add(a, b):\n    time.sleep(0.6)\n    return a + b"
    reward = verify_code(fenced(source), FIVE, timeout_s=1.5, after_timeout_s=0.1)
    assert reward.passed and reward.details["cases"] == ["pass"] * 5


def test_after_a_timeout_the_fast_cases_still_pass_within_the_budget():
    source = "def add(a, b):\n    while a == 0:\n        pass\n    return a + b"
    reward = verify_code(fenced(source), FIVE, timeout_s=1.0, after_timeout_s=1.0)
    assert reward.details["cases"] == ["timeout"] + ["pass"] * 4 and reward.score == 0.8
    assert reward.failure == FailureClass.WRONG_ANSWER  # partly right: scored as such, not as infrastructure


@pytest.mark.parametrize("options, message", [
    ({"after_timeout_s": -1}, "after_timeout_s"), ({"after_timeout_s": float("inf")}, "after_timeout_s"),
    ({"timeout_s": 0}, "timeout_s"), ({"after_timeout_s": "1"}, "after_timeout_s"),
])
def test_time_options_are_checked(options, message):
    with pytest.raises(VerifyError, match=message):
        verify_code(fenced("def add(a, b):\n    return a + b"), ADD, **options)


def test_trajectory_and_final_state_files():
    trajectory = Trajectory(task_id="t", domain="code", token_ids=[], loss_mask=[], behaviour_logprobs=[],
                            policy_versions=[], prompt_length=0, reward=Reward(0.0, False),
                            messages=[{"role": "user", "content": "add"},
                                      {"role": "assistant", "content": fenced("def add(a, b):\n    return 0")},
                                      {"role": "assistant", "content": fenced("def add(a, b):\n    return a + b")}])
    assert verify_code(trajectory, ADD).passed
    final_state = {"files": {"pkg/helpers.py": "def plus(a, b):\n    return a + b\n",
                             "solution.py": "from pkg.helpers import plus\ndef add(a, b):\n    return plus(a, b)\n"}}
    assert verify_code("", ADD, final_state=final_state, solution_file="solution.py").passed
    assert verify_code("", ADD, final_state={"files": {}}, solution_file="solution.py").details["reason"] == "no_code"


@pytest.mark.parametrize("files", [{"../up.py": "x"}, {"solution.py/x": "y"}, {"a": "1", "a/b": "2"},
                                   {"_harness.pyc": "not bytecode"}, {"notes.txt": "\ud800"}, {"n" * 300: "x"}])
def test_a_workspace_the_jail_cannot_hold_is_judged_without_those_files_never_an_infra_failure(files):
    # Shipped as is, the jail could not start: an infrastructure failure is masked, not scored, so a policy that
    # left such names in its workspace would never see its wrong answers scored.
    wrong = verify_code(fenced("def add(a, b):\n    return 0"), ADD, final_state={"files": files})
    assert not wrong.is_infrastructure_failure and wrong.failure == FailureClass.WRONG_ANSWER, wrong.details
    assert wrong.details["dropped_files"] == sorted(set(files) - {"a"})
    assert verify_code(fenced("def add(a, b):\n    return a + b"), ADD, final_state={"files": files}).passed


def test_a_solution_file_that_is_not_utf8_is_scored_not_an_infra_failure():
    reward = verify_code("", ADD, final_state={"files": {"solution.py": "def add(a, b):\n    return '\ud800'\n"}},
                         solution_file="solution.py")
    assert not reward.is_infrastructure_failure and reward.details["reason"] == "not_utf8", reward.details


def test_a_workspace_larger_than_the_jail_is_scored_not_an_infra_failure():
    huge = {"data.bin": b"x" * (1 << 20)}
    reward = verify_code(fenced("def add(a, b):\n    return a + b"), ADD, limits={"workdir_mb": 1},
                         final_state={"files": huge})
    assert not reward.is_infrastructure_failure and reward.details["reason"] == "workspace_too_large", reward.details


def test_sandbox_infra_failure_is_not_a_score():
    class Broken:
        jail = Sandbox().jail
        calls = 0

        def run(self, cmd, **options):
            Broken.calls += 1
            return RunResult(status=RunStatus.INFRA_ERROR, error="jail could not start")

    reward = verify_code(fenced("def add(a, b):\n    return a + b"), ADD, sandbox=Broken(), infra_retries=2)
    assert reward.failure == FailureClass.SANDBOX and reward.is_infrastructure_failure
    assert Broken.calls == 3 and reward.details["infra_retries"] == 2


def test_a_harness_that_cannot_run_is_an_error_not_a_zero():
    with SandboxPool(1) as pool:
        broken = Sandbox(pool=pool, jail=JailOptions(python="false"))  # no interpreter: the harness never runs
        with pytest.raises(VerifyError, match="harness does not work in this sandbox"):
            verify_code(fenced("def add(a, b):\n    return a + b"), ADD, sandbox=broken)


def _recording(box, seen):
    class Recording:  # the same pool and jail: the pool's self-test and its verdict on bytecode are this pool's
        jail, pool = box.jail, box.pool

        def run(self, cmd, **options):
            seen.append(cmd[-2])  # the harness file the jail's Python was told to run
            return box.run(cmd, **options)

    return Recording()


def test_the_harness_runs_as_bytecode_only_where_the_jail_s_python_judges_with_it(monkeypatch):
    import importlib.util

    from posttrain.verify import code_tests

    answer = fenced("def add(a, b):\n    return a + b")
    with SandboxPool(1) as pool:
        box = Sandbox(pool=pool)
        probe = box.run([box.jail.python, "-c",
                         "import importlib.util, sys; sys.stdout.write(importlib.util.MAGIC_NUMBER.hex())"])
        same_bytecode = probe.stdout.strip() == importlib.util.MAGIC_NUMBER.hex()
        seen = []
        assert verify_code(answer, ADD, sandbox=_recording(box, seen)).passed
        assert seen == ["_harness.py", "_harness.pyc", "_harness.pyc" if same_bytecode else "_harness.py"]
        partly = verify_code(fenced("def add(a, b):\n    return a * b"), ADD, sandbox=_recording(box, seen))
        assert partly.score == 0.25 and partly.details["cases"] == ["wrong output", "pass", "wrong output",
                                                                    "wrong output"]  # only 2 * 2 == 2 + 2
        assert seen[3:] == seen[2:3]  # judged the same way as the first program

    # Bytecode the jail's Python cannot run (another version's; simulated here by a bad header): the self-test
    # finds it out, and every judgement runs the source, scored as ever.
    monkeypatch.setattr(code_tests, "_HARNESS_BYTECODE", b"\0" * 16 + b"not bytecode")
    with SandboxPool(1) as pool:
        seen = []
        assert verify_code(answer, ADD, sandbox=_recording(Sandbox(pool=pool), seen)).passed
        assert seen == ["_harness.py", "_harness.pyc", "_harness.py"]


def test_outside_a_jail_the_harness_never_kills_every_process():
    """The harness stops leftovers with kill(-1) only inside a jail's PID namespace; on the unsafe backend that
    would be every process on the machine, so there it must be told it is not jailed."""
    with SandboxPool(1, backend="unsafe-local") as pool:
        local = Sandbox(pool=pool)

        class Guarded:
            jail = local.jail
            pool = local.pool

            def run(self, cmd, **options):
                config = json.loads(next(v for k, v in options["files"].items() if k.startswith(".config")))
                assert config["jailed"] is False
                return local.run(cmd, **options)

        with pytest.warns(UnsafeSandboxWarning):
            assert verify_code(fenced("def add(a, b):\n    return a + b"), ADD, sandbox=Guarded()).passed


def test_jail_limits_still_apply_to_the_candidate():
    with SandboxPool(1) as pool:
        bomb = fenced("def add(a, b):\n    x = bytearray(900 << 20)\n    return a + b")
        reward = verify_code(bomb, ADD, sandbox=Sandbox(pool=pool), limits=Limits(timeout_s=20, memory_mb=256))
        assert reward.score == 0 and not reward.is_infrastructure_failure


def test_limits_can_come_from_a_task_spec():
    from posttrain.types import Task
    from posttrain.verify import check_task, verify

    spec = {"tests": ADD, "limits": {"memory_mb": 128, "output_bytes": 1 << 16}}
    task = Task(id="t", domain="code", messages=[], verifier="code", verifier_args=spec)
    assert verify(task, fenced("def add(a, b):\n    return a + b")).passed
    with pytest.raises(VerifyError, match="unknown sandbox limit"):
        check_task(Task(id="t", domain="code", messages=[], verifier="code",
                        verifier_args={"tests": ADD, "limits": {"memory": 1}}))


@pytest.mark.parametrize("tests, message", [
    ({"function": "1bad", "cases": [{"args": [], "expected": 1}]}, "identifier"),
    ({"function": "f", "cases": []}, "non-empty"),
    ({"function": "f", "cases": [{"args": [1]}]}, "expected"),
    ({"function": "f", "cases": [{"args": 1, "expected": 1}]}, "args must be a list"),
    ({"function": "f", "cases": [{"args": [object()], "expected": 1}]}, "JSON"),
    ([{"stdin": "1"}], "stdin/stdout"),
    ("assert (", "does not parse"),
    ("x = 1", "no top-level assert"),
    (42, "unknown test shape"),
])
def test_malformed_test_specs_are_verify_errors(tests, message):
    with pytest.raises(VerifyError, match=message):
        parse_tests(tests)


def test_identical_judgements_run_one_jail_and_each_caller_gets_its_own_verdict():
    """An RL group's samples are often one program written several times (three judgements in four, in the
    demo's RL): it is judged once, its callers waiting on that one jail; anything that changes the verdict
    (the program, the limits, the sandbox) is judged anew, and `reuse: false` judges every call."""
    right, wrong = fenced("def add(a, b):\n    return a + b"), fenced("def add(a, b):\n    return a * b")
    with SandboxPool(2) as pool:
        box = Sandbox(pool=pool)
        seen = []
        recording = _recording(box, seen)
        assert verify_code(right, ADD, sandbox=recording).passed  # the pool's self-test, then this program
        before = len(seen)
        with concurrent.futures.ThreadPoolExecutor(8) as threads:
            rewards = list(threads.map(lambda answer: verify_code(answer, ADD, sandbox=recording), [right, wrong] * 8))
        assert len(seen) == before + 1, "one jail for the 8 callers of the new program, none for the known one"
        assert [r.score for r in rewards] == [1.0, 0.25] * 8
        assert [r.details["cases"] for r in rewards[1::2]] == [["wrong output", "pass", "wrong output",
                                                                "wrong output"]] * 8
        assert sum(not r.details.get("reused") for r in rewards) == 1
        rewards[1].details["mine"] = True  # a caller adds to its details: another's are not touched
        assert all("mine" not in r.details for r in rewards[3::2])
        for again in (dict(reuse=False), dict(timeout_s=3.0), dict(limits=Limits(timeout_s=30, memory_mb=256)),
                      dict(final_state={"files": {"notes.txt": "x"}})):
            count = len(seen)
            assert verify_code(wrong, ADD, sandbox=recording, **again).score == 0.25
            assert len(seen) == count + 1, again
        own = verify_code(wrong, ADD, sandbox=box)  # another sandbox class on the same pool: its own judgement
        assert own.score == 0.25 and not own.details.get("reused")
        assert verify_code(wrong, ADD, sandbox=box).details["reused"] is True
        other_seen = []  # another class of the same name (one factory, two calls): its own judgement too
        twin = _recording(box, other_seen)
        assert type(twin).__qualname__ == type(recording).__qualname__ and type(twin) is not type(recording)
        assert not verify_code(wrong, ADD, sandbox=twin).details.get("reused") and len(other_seen) == 1


def test_an_infrastructure_failure_is_never_reused():
    with SandboxPool(1) as pool:
        box = Sandbox(pool=pool)

        class Flaky:  # the jail fails to start once, then works
            jail, pool = box.jail, box.pool
            failures = 1
            runs = 0

            def run(self, cmd, **options):
                Flaky.runs += 1
                if Flaky.failures and cmd[-2].startswith("_harness") and Flaky.runs > 2:  # after the self-test
                    Flaky.failures -= 1
                    return RunResult(status=RunStatus.INFRA_ERROR, error="jail could not start")
                return box.run(cmd, **options)

        answer = fenced("def add(a, b):\n    return a - b + 2 * b")
        first = verify_code(answer, ADD, sandbox=Flaky(), infra_retries=0)
        assert first.is_infrastructure_failure
        second = verify_code(answer, ADD, sandbox=Flaky(), infra_retries=0)
        assert second.passed and not second.details.get("reused")
        assert verify_code(answer, ADD, sandbox=Flaky(), infra_retries=0).details["reused"] is True
