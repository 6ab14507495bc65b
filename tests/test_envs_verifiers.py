"""The verifiers adapter (``env: verifiers``): prime-rl verifiers (v1) tasksets written in the test with the package's
public API (`vf.Taskset`, `vf.Task`, `vf.TaskData`, `@vf.reward`, `vf.Toolset`, `@vf.tool`), loaded by id through
its own loader, rolled out by posttrain's episode loop (the policy's ids verbatim) and scored by their rubric."""

from __future__ import annotations

import asyncio
import json
import textwrap

import pytest
from test_envs_scripted import ScriptedEngine

from posttrain.envs import rollout_episode
from posttrain.tasks import TaskError, get_domain, sample_tasks
from posttrain.types import FailureClass, SamplingParams

END = "<|end|>"

SINGLE_TURN = '''
import verifiers.v1 as vf

class SumData(vf.TaskData):
    answer: str

class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply == self.data.answer else 0.0

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return 1.0 if len(trace.last_reply) <= 3 else 0.0

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)

class SumConfig(vf.TasksetConfig):
    num_tasks: int = 6

class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        return [SumTask(SumData(prompt=f"What is {i}+{i + 1}?", system_prompt="Answer with a number.",
                                answer=str(2 * i + 1))) for i in range(self.config.num_tasks)]

__all__ = ["SumTaskset"]
'''

TOOLS = '''
import verifiers.v1 as vf

class Calculator(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    def multiply(self, a: int, b: int) -> str:
        """Multiply two integers."""
        return str(int(a) * int(b))

class ProductData(vf.TaskData):
    answer: str

class ProductTask(vf.Task[ProductData]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply == self.data.answer else 0.0

    @vf.reward(weight=0.0)
    async def used_tool(self, trace: vf.Trace) -> float:
        return 1.0 if any(m.content == self.data.answer for m in trace.tool_messages) else 0.0

class ProductTaskset(vf.Taskset[ProductTask, vf.TasksetConfig]):
    def load(self):
        pairs = [(123, 45), (67, 89), (301, 27)]
        return [ProductTask(ProductData(prompt=f"What is {a}*{b}?", answer=str(a * b))) for a, b in pairs]

__all__ = ["ProductTaskset"]
'''

# The same tasks with partial credit for the tool's right result: a rubric whose prefix scores rise turn by turn.
PROGRESS = TOOLS.replace("@vf.reward(weight=0.0)", "@vf.reward(weight=0.5)").replace("ProductTaskset",
                                                                                      "ProgressTaskset")

BROKEN = TOOLS.replace('return 1.0 if trace.last_reply == self.data.answer else 0.0',
                       'raise RuntimeError("the judge service is down")').replace("ProductTaskset", "BrokenTaskset")


# The progress rubric, slowed down: scoring a trace (or turn prefix) of k assistant turns sleeps DELAYS[k] seconds.
SLOW = PROGRESS.replace("import verifiers.v1 as vf",
                        "import asyncio\nimport verifiers.v1 as vf\n\nDELAYS = {}").replace(
    "    async def correct(self, trace: vf.Trace) -> float:\n",
    "    async def correct(self, trace: vf.Trace) -> float:\n"
    "        await asyncio.sleep(DELAYS.get(trace.num_turns, 0.0))\n").replace("ProgressTaskset", "SlowTaskset")

# Rubrics that block the thread they run on until the test releases them (or a minute passes): a sync @vf.reward,
# and an async one that calls a blocking function -- neither lets an event loop's timer fire.
HUNG = """
import threading
import verifiers.v1 as vf

RELEASE = threading.Event()
RUNNING = []

class HungTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=1.0)
    {kind}def digits(self, trace: vf.Trace) -> float:
        RUNNING.append(threading.current_thread())
        RELEASE.wait(60.0)
        return 1.0

class HungTaskset(vf.Taskset[HungTask, vf.TasksetConfig]):
    def load(self):
        return [HungTask(vf.TaskData(prompt=f"Reply with digits only (#{{i}}).")) for i in range(4)]

__all__ = ["HungTaskset"]
"""


@pytest.fixture(autouse=True)
def tasksets(tmp_path, monkeypatch):
    for name, source in {"vf_sum_tasks": SINGLE_TURN, "vf_product_tasks": TOOLS, "vf_broken_tasks": BROKEN,
                         "vf_progress_tasks": PROGRESS, "vf_slow_tasks": SLOW,
                         "vf_hung_sync_tasks": HUNG.format(kind=""),
                         "vf_hung_async_tasks": HUNG.format(kind="async ")}.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))


def run(task, tokenizer, script):
    engine = ScriptedEngine(tokenizer, script)
    return asyncio.run(rollout_episode(engine, task, tokenizer, SamplingParams(max_new_tokens=48))), engine


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>{END}"


def test_a_single_turn_taskset_is_scored_by_its_rubric_on_the_sampled_tokens(tiny_tokenizer):
    domain = get_domain("verifiers", taskset="vf_sum_tasks", config={"num_tasks": 6})
    task = sample_tasks(domain, 1, level=1, seed=0)[0]
    assert task.messages[0] == {"role": "system", "content": "Answer with a number."}
    answer = str(2 * int(task.prompt.split()[2].split("+")[0]) + 1)
    trajectory, engine = run(task, tiny_tokenizer, [answer + END])
    reward = trajectory.reward
    assert (reward.score, reward.passed, reward.failure) == (1.5, True, FailureClass.NONE)
    assert reward.components == {"correct": 1.0, "brief": 1.0}
    assert reward.details["weights"] == {"correct": 1.0, "brief": 0.5} and reward.details["metrics"] == {"turns": 1.0}
    policy_ids = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask) if m]
    assert policy_ids == engine.returned[task.id][0]  # the engine's ids, never re-tokenized

    wrong, _ = run(task, tiny_tokenizer, ["12345" + END])
    assert (wrong.reward.score, wrong.reward.passed) == (0.0, False)
    assert wrong.reward.failure is FailureClass.WRONG_ANSWER


def test_a_multi_turn_tool_taskset_runs_its_tools_and_scores_the_transcript(tiny_tokenizer):
    domain = get_domain("verifiers", taskset="vf_product_tasks", max_steps=3)
    task = sample_tasks(domain, 1, level=1, seed=1)[0]
    a, b = (int(x) for x in task.prompt.removeprefix("What is ").rstrip("?").split("*"))
    trajectory, engine = run(task, tiny_tokenizer, [call("multiply", a=a, b=b), f"{a * b}{END}"])
    reward = trajectory.reward
    assert reward.passed and reward.components == {"correct": 1.0, "used_tool": 1.0, "process": 1.0}
    assert (trajectory.steps, trajectory.tool_calls, trajectory.tool_calls_ok) == (2, 1, 1)
    assert {"role": "tool", "name": "multiply", "content": str(a * b)} in trajectory.messages
    policy_ids = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask) if m]
    assert policy_ids == [i for turn in engine.returned[task.id] for i in turn]

    # A call the tool rejects is the model's failed call (an error observation); the process signal drops.
    bad, _ = run(task, tiny_tokenizer, [call("multiply", a=a), call("multiply", a=a, b=b), f"{a * b}{END}"])
    assert bad.reward.passed and bad.failed_steps == 1
    assert bad.reward.components["process"] == pytest.approx(0.5)
    assert any(m["content"].startswith("error: TypeError") for m in bad.messages if m["role"] == "tool")


def test_turn_scores_give_the_rubrics_score_of_each_turns_prefix_as_the_process_reward(tiny_tokenizer):
    domain = get_domain("verifiers", taskset="vf_progress_tasks", max_steps=4, turn_scores=True)
    task = sample_tasks(domain, 1, level=1, seed=1)[0]
    assert task.verifier_args["turn_scores"] is True
    a, b = (int(x) for x in task.prompt.removeprefix("What is ").rstrip("?").split("*"))
    # turn 1: a call the tool rejects (no credit); turn 2: the right call (the tool's result: used_tool, 0.5);
    # turn 3: the answer (correct 1.0 + used_tool 0.5)
    trajectory, _ = run(task, tiny_tokenizer, [call("multiply", a=a), call("multiply", a=a, b=b), f"{a * b}{END}"])
    reward = trajectory.reward
    assert (reward.score, reward.passed) == (1.5, True)
    assert reward.details["step_rewards"] == [0.0, 0.5, 1.5]
    assert reward.components == {"correct": 1.0, "used_tool": 1.0, "process": pytest.approx(2.0 / 3)}

    # Without the option the process signal is the tool env's share of calls that succeeded, as before.
    plain = sample_tasks(get_domain("verifiers", taskset="vf_progress_tasks", max_steps=4), 1, level=1, seed=1)[0]
    trajectory, _ = run(plain, tiny_tokenizer, [call("multiply", a=a), call("multiply", a=a, b=b), f"{a * b}{END}"])
    assert trajectory.reward.components["process"] == pytest.approx(0.5)
    assert trajectory.reward.details["step_rewards"] == [0.0, 1.0, None]


def test_each_turns_scoring_has_its_own_timeout(tiny_tokenizer):
    """A slow turn does not spend the other scorings' time; a turn slower than its own limit is an infrastructure
    failure (masked), never a 0."""
    import time

    domain = get_domain("verifiers", taskset="vf_slow_tasks", max_steps=4, turn_scores=True, score_timeout_s=2.0)
    task = sample_tasks(domain, 1, level=1, seed=1)[0]
    assert task.verifier_args["timeout_s"] == 2.0
    a, b = (int(x) for x in task.prompt.removeprefix("What is ").rstrip("?").split("*"))
    script = [call("multiply", a=a), call("multiply", a=a, b=b), f"{a * b}{END}"]
    delays = __import__("vf_slow_tasks").DELAYS

    # Four scorings (the whole trace, then turns 1, 2 and 3 -- the last prefix is the whole transcript again):
    # 0.9 + 1.4 + 0 + 0.9 s, more than one 2 s budget together, each well within its own.
    delays.update({1: 1.4, 3: 0.9})
    started = time.monotonic()
    trajectory, _ = run(task, tiny_tokenizer, script)
    assert not trajectory.reward.is_infrastructure_failure, trajectory.reward.details
    assert time.monotonic() - started >= 3.2  # the scorings together did take longer than one budget
    assert trajectory.reward.passed and trajectory.reward.details["step_rewards"] == [0.0, 0.5, 1.5]

    # Turn 2's scoring alone outlasts its 2 s: the episode is masked, its error names the turn.
    delays.clear()
    delays[2] = 30.0
    started = time.monotonic()
    trajectory, _ = run(task, tiny_tokenizer, script)
    assert time.monotonic() - started < 20  # abandoned at its limit, not waited for
    reward = trajectory.reward
    assert reward.failure is FailureClass.INFRA and reward.is_infrastructure_failure
    assert "turn 2's prefix took longer than 2 s" in reward.details["error"] and sum(trajectory.loss_mask) == 0


def test_a_rubric_that_crashes_is_an_infrastructure_failure(tiny_tokenizer):
    task = sample_tasks(get_domain("verifiers", taskset="vf_broken_tasks", max_steps=2), 1, level=1)[0]
    trajectory, _ = run(task, tiny_tokenizer, ["7" + END])
    assert trajectory.reward.failure is FailureClass.INFRA and sum(trajectory.loss_mask) == 0
    assert "judge service is down" in trajectory.reward.details["error"]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_rubric_that_blocks_its_thread_is_an_infrastructure_failure_at_its_timeout(tiny_tokenizer, kind):
    """A sync reward function (or an async one that blocks) that hangs: the episode is masked as an infrastructure
    failure after `score_timeout_s`, and the stuck function is left running in its own (daemon) thread."""
    import time

    domain = get_domain("verifiers", taskset=f"vf_hung_{kind}_tasks", max_steps=1, score_timeout_s=1.0)
    task = sample_tasks(domain, 1, level=1, seed=0)[0]
    module = __import__(f"vf_hung_{kind}_tasks")
    try:
        started = time.monotonic()
        trajectory, _ = run(task, tiny_tokenizer, ["42" + END])
        assert time.monotonic() - started < 30  # the rubric blocks for 60 s: it was not waited for
        reward = trajectory.reward
        assert reward.failure is FailureClass.INFRA and reward.is_infrastructure_failure
        assert "the whole trace took longer than 1 s" in reward.details["error"] and sum(trajectory.loss_mask) == 0
        (stuck,) = module.RUNNING
        assert stuck.daemon and stuck.is_alive()  # abandoned, not killed: it runs on until the function returns
    finally:
        module.RELEASE.set()
    stuck.join(10.0)
    assert not stuck.is_alive()


def test_an_unknown_taskset_is_a_clear_error():
    with pytest.raises(TaskError, match="vf_no_such_taskset"):
        get_domain("verifiers", taskset="vf_no_such_taskset")
