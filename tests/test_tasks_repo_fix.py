"""The agentic repository-fix domain end to end: scripted agents, the sandbox, and a reward judged on the files."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_envs_scripted import ScriptedEngine, demo_turns
from test_envs_tools import needs_bwrap

from posttrain.envs import rollout_episode
from posttrain.envs.testing import run_project_tests
from posttrain.sandbox import JailOptions, Limits, RunResult
from posttrain.tasks import get_domain, sample_tasks
from posttrain.tasks.repo_fix import FAMILIES, TEST_FILE
from posttrain.types import FailureClass, SamplingParams, Task
from posttrain.verify import verify

END = "<|end|>"
SAMPLING = SamplingParams(max_new_tokens=4096)


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>{END}"


def episode(tokenizer, task: Task, script, sandbox=None):
    engine = ScriptedEngine(tokenizer, script)
    return asyncio.run(rollout_episode(engine, task, tokenizer, SAMPLING, sandbox, max_context_tokens=100_000))


@pytest.fixture(scope="module")
def tasks() -> dict[int, Task]:
    source = get_domain("repo_fix", show_tool_schemas=False)
    return {level: sample_tasks(source, 1, level=level, seed=11)[0] for level in (1, 2, 3)}


def test_task_shape(tasks):
    for level, task in tasks.items():
        files = task.env_args["files"]
        assert TEST_FILE in files and task.env == "tools" and task.verifier == "repo_tests"
        assert set(task.tools) == {"list_files", "read_file", "write_file", "run_tests"}
        assert len(task.metadata["bugs"]) == (2 if level == 3 else 1)
        for path, fixed in task.metadata["fixed_files"].items():
            assert files[path] != fixed  # the bug is in the shipped project
        expected_values = [json.dumps(c["expected"]) for check in task.verifier_args["checks"] for c in check["cases"]]
        assert expected_values and task.verifier_args["checks"][0]["file"] in files


@needs_bwrap
@pytest.mark.bwrap
def test_demonstrations_replay_to_a_pass_with_the_same_observations(tiny_tokenizer, tasks):
    source = get_domain("repo_fix", show_tool_schemas=False)
    for task in tasks.values():
        sample = source.demonstration(task)
        trajectory = episode(tiny_tokenizer, task, demo_turns(tiny_tokenizer, sample.messages))
        assert trajectory.reward.passed and trajectory.reward.failure is FailureClass.NONE, trajectory.reward.details
        assert trajectory.messages == sample.messages  # run_tests' real report equals the demonstration's
        assert trajectory.tool_calls == trajectory.tool_calls_ok == trajectory.steps - 1
        steps = trajectory.steps
        assert trajectory.reward.components["step_cost"] == pytest.approx(-0.02 * (steps - 1))
        assert tiny_tokenizer.decode(trajectory.token_ids) == tiny_tokenizer.apply_chat_template(
            trajectory.messages, tokenize=False)


@needs_bwrap
@pytest.mark.bwrap
def test_claims_and_test_edits_earn_nothing(tiny_tokenizer, tasks):
    task = tasks[1]
    # Rewriting the tests so they pass, running them, and announcing success: the code is still broken.
    script = [call("write_file", path=TEST_FILE, content="def test_ok():\n    assert True\n"), call("run_tests"),
              "All tests pass now: 1 passed, 0 failed." + END]
    trajectory = episode(tiny_tokenizer, task, script)
    assert "1 passed, 0 failed" in trajectory.messages[4]["content"]
    assert trajectory.reward.score == 0 and trajectory.reward.failure is FailureClass.WRONG_ANSWER
    # Deleting the module under test does not help either.
    path = next(iter(task.metadata["fixed_files"]))
    script = [call("write_file", path=path, content="raise SystemExit(0)\n"), "Fixed." + END]
    assert episode(tiny_tokenizer, task, script).reward.score == 0


@needs_bwrap
@pytest.mark.bwrap
def test_failed_tool_calls_then_recovery(tiny_tokenizer, tasks):
    task = tasks[2]
    [(path, fixed)] = task.metadata["fixed_files"].items()
    script = [
        call("read_file", path="../../etc/passwd"),  # refused: outside the workspace
        '<tool_call>{"name": "write_file", "arguments": {"path": "x.py"</tool_call>' + END,  # malformed
        call("git_diff"),  # not a tool of this task
        call("run_tests"),
        call("write_file", path=path, content=fixed),
        call("run_tests"),
        "Fixed it." + END,
    ]
    trajectory = episode(tiny_tokenizer, task, script)
    assert trajectory.reward.passed
    assert (trajectory.steps, trajectory.tool_calls, trajectory.tool_calls_ok, trajectory.failed_steps) == (7, 6, 3, 3)
    reports = [m["content"] for m in trajectory.messages if m["role"] == "tool" and "passed," in m["content"]]
    assert "FAILED" in reports[0] and "FAILED" not in reports[1]


@needs_bwrap
@pytest.mark.bwrap
def test_running_out_of_steps_unsolved(tiny_tokenizer, tasks):
    task = tasks[1]
    trajectory = episode(tiny_tokenizer, task, [call("list_files")])
    assert trajectory.steps == task.max_steps and trajectory.tool_calls_ok == task.max_steps
    assert not trajectory.reward.passed and trajectory.reward.failure is FailureClass.WRONG_ANSWER


def test_a_jail_that_cannot_start_is_a_sandbox_failure(tiny_tokenizer, tasks):
    class BrokenSandbox:
        limits, jail = Limits(), JailOptions()

        async def arun(self, cmd, **options):
            return RunResult.infra("bwrap: Creating new namespace failed: Operation not permitted")

    trajectory = episode(tiny_tokenizer, tasks[1], [call("run_tests"), "done" + END], sandbox=BrokenSandbox())
    assert trajectory.reward.failure is FailureClass.SANDBOX and trajectory.reward.is_infrastructure_failure
    assert "namespace" in trajectory.reward.details["error"] and sum(trajectory.loss_mask) == 0


def test_verifier_needs_the_workspace(tasks):
    reward = verify(tasks[1], "I fixed it, all tests pass.")
    assert reward.score == 0 and reward.failure is FailureClass.FORMAT


def _every_bug_task(level: int) -> list[Task]:
    source = get_domain("repo_fix")
    found: dict[tuple, Task] = {}
    for task in sample_tasks(source, 150, level=level, seed=3):
        found.setdefault((task.metadata["family"], tuple(task.metadata["bug_ids"])), task)
    return list(found.values())


@needs_bwrap
@pytest.mark.bwrap
@pytest.mark.slow
@pytest.mark.parametrize("level", [1, 2, 3])
def test_every_bug_fails_the_visible_tests_and_the_verifier_and_its_fix_passes(level):
    tasks = _every_bug_task(level)
    every_bug = sum(len(f.bugs) for f in FAMILIES.values())
    helper_bugs = sum(b.function in {fn.name for fn in f.functions if fn.helper} for f in FAMILIES.values()
                      for b in f.bugs)
    assert len(tasks) == {1: every_bug, 2: helper_bugs}.get(level, len(tasks)) and len(tasks) >= 9
    for task in tasks:
        broken = task.env_args["files"]
        fixed = {**broken, **task.metadata["fixed_files"]}
        assert verify(task, "", {"files": broken}).score == 0
        assert "FAILED" in asyncio.run(run_project_tests(broken, None, {})).text
        assert verify(task, "", {"files": fixed}).score == 1, task.metadata
        report = asyncio.run(run_project_tests(fixed, None, {})).text
        assert "FAILED" not in report and "ERROR" not in report
