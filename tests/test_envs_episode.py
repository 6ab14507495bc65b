"""The episode loop with scripted policies: token-exact trajectories, tool use, and every failure path."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import pytest
from test_envs_scripted import GatedPolicy, ScriptedEngine, SlowAsyncPolicy

from posttrain.envs import (
    EnvError,
    SyncEnginePolicy,
    ToolInfraError,
    as_policy,
    rollout_episode,
    rollout_group,
    rollout_many,
    rollout_stats,
    run_episodes,
    tool,
)
from posttrain.tasks import get_domain, sample_tasks
from posttrain.types import FailureClass, SamplingParams, Task

END = "<|end|>"
SAMPLING = SamplingParams(max_new_tokens=64)


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>{END}"


@pytest.fixture()
def calc_task() -> Task:
    return sample_tasks(get_domain("calculator"), 1, level=3, seed=5)[0]


def run(engine, task, tokenizer, **kwargs):
    return asyncio.run(rollout_episode(engine, task, tokenizer, kwargs.pop("sampling", SAMPLING), **kwargs))


def answer_of(task: Task) -> str:
    return task.metadata["answer"]


def test_multi_turn_tool_episode_is_token_exact(tiny_tokenizer, calc_task):
    expression = calc_task.metadata["expression"]
    engine = ScriptedEngine(tiny_tokenizer, [call("calculator", expression=expression), answer_of(calc_task) + END])
    trajectory = run(engine, calc_task, tiny_tokenizer)

    assert trajectory.reward.passed and trajectory.reward.failure is FailureClass.NONE
    assert (trajectory.steps, trajectory.tool_calls, trajectory.tool_calls_ok, trajectory.failed_steps) == (2, 1, 1, 0)
    # Token in, token out: prompt ids, then exactly the engine's ids, then the observation's delta ids.
    prompt_text = tiny_tokenizer.apply_chat_template(calc_task.messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tiny_tokenizer.encode(prompt_text, add_special_tokens=False)
    first, second = engine.returned[calc_task.id]
    observation = tiny_tokenizer.encode(f"<|tool|>{answer_of(calc_task)}{END}<|assistant|>", add_special_tokens=False)
    assert trajectory.token_ids == prompt_ids + first + observation + second
    assert trajectory.prompt_length == len(prompt_ids)
    assert trajectory.loss_mask == [0] * len(prompt_ids) + [1] * len(first) + [0] * len(observation) + [1] * len(second)
    policy = [i for i, m in enumerate(trajectory.loss_mask) if m]
    assert [trajectory.behaviour_logprobs[i] for i in policy[: len(first)]] == pytest.approx(
        [-0.01 * (i + 1) for i in range(len(first))])
    assert {trajectory.policy_versions[i] for i in policy} == {7} and trajectory.min_policy_version == 7
    assert trajectory.policy_tokens == len(first) + len(second)
    assert trajectory.observation_tokens == len(observation)
    # Decoding the sequence gives the chat template's rendering of the transcript.
    rendered = tiny_tokenizer.apply_chat_template(trajectory.messages, tokenize=False)
    assert tiny_tokenizer.decode(trajectory.token_ids, skip_special_tokens=False) == rendered
    assert [m["role"] for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]
    assert trajectory.messages[1]["tool_calls"][0]["function"] == {"name": "calculator",
                                                                   "arguments": {"expression": expression}}
    assert trajectory.wall_s > 0 and trajectory.metadata["final_answer"] == answer_of(calc_task)


def test_trajectory_round_trips_through_json(tiny_tokenizer, calc_task):
    engine = ScriptedEngine(tiny_tokenizer, [call("calculator", expression="2*3"), "6" + END])
    trajectory = run(engine, calc_task, tiny_tokenizer)
    again = type(trajectory).from_dict(json.loads(json.dumps(trajectory.to_dict())))
    assert again.token_ids == trajectory.token_ids and again.reward.failure == trajectory.reward.failure


def test_observation_after_a_stop_string_closes_the_turn(tiny_tokenizer, calc_task):
    # The engine stopped on "</tool_call>" (a stop string), not on eos: the env adds the template's "<|end|>".
    expression = calc_task.metadata["expression"]
    engine = ScriptedEngine(tiny_tokenizer, [call("calculator", expression=expression)[: -len(END)],
                                             answer_of(calc_task) + END])
    trajectory = run(engine, calc_task, tiny_tokenizer)
    assert trajectory.reward.passed
    rendered = tiny_tokenizer.apply_chat_template(trajectory.messages, tokenize=False)
    assert tiny_tokenizer.decode(trajectory.token_ids, skip_special_tokens=False) == rendered


def test_single_turn_success_and_wrong_answer(tiny_tokenizer):
    task = sample_tasks(get_domain("arithmetic"), 1, level=2)[0]
    good = run(ScriptedEngine(tiny_tokenizer, [task.verifier_args["answer"] + END]), task, tiny_tokenizer)
    assert good.reward.passed and good.steps == 1 and good.tool_calls == 0
    assert tiny_tokenizer.decode(good.token_ids) == tiny_tokenizer.apply_chat_template(good.messages, tokenize=False)
    bad = run(ScriptedEngine(tiny_tokenizer, ["1" + END]), task, tiny_tokenizer)
    assert not bad.reward.passed and bad.reward.failure is FailureClass.WRONG_ANSWER and bad.reward.score == 0


def test_malformed_call_and_unknown_tool_are_failed_calls_and_the_episode_goes_on(tiny_tokenizer, calc_task):
    expression = calc_task.metadata["expression"]
    script = [
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>' + END,  # bad JSON
        call("web_search", query=expression),  # not a tool of this task
        call("calculator", expression=expression),
        answer_of(calc_task) + END,
    ]
    calc_task.max_steps = 4
    trajectory = run(ScriptedEngine(tiny_tokenizer, script), calc_task, tiny_tokenizer)
    assert trajectory.reward.passed
    assert (trajectory.steps, trajectory.tool_calls, trajectory.tool_calls_ok, trajectory.failed_steps) == (4, 3, 1, 2)
    tool_messages = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert tool_messages[0].startswith("error: malformed tool call: invalid JSON")
    assert tool_messages[1] == "error: unknown tool 'web_search' (tools: calculator)"
    # Recovery after failed steps is what eval's recovery rate counts.
    assert trajectory.failed_steps and trajectory.reward.passed


def test_tool_error_then_recovery(tiny_tokenizer, calc_task):
    script = [call("calculator", expression="1/0"), call("calculator", expression=calc_task.metadata["expression"]),
              answer_of(calc_task) + END]
    trajectory = run(ScriptedEngine(tiny_tokenizer, script), calc_task, tiny_tokenizer)
    assert trajectory.reward.passed and trajectory.failed_steps == 1 and trajectory.tool_calls_ok == 1
    assert trajectory.messages[2] == {"role": "tool", "name": "calculator",
                                      "content": "error: calculator: division by zero"}


def test_bad_arguments_are_a_tool_error(tiny_tokenizer, calc_task):
    script = [call("calculator", expr="2+2"), "4" + END]
    trajectory = run(ScriptedEngine(tiny_tokenizer, script), calc_task, tiny_tokenizer)
    assert trajectory.messages[2]["content"].startswith("error: bad arguments for 'calculator'")
    assert trajectory.reward.failure is FailureClass.TOOL_ERROR  # the only call failed, and the answer is wrong


def test_steps_run_out_with_failing_calls_is_a_tool_error(tiny_tokenizer, calc_task):
    trajectory = run(ScriptedEngine(tiny_tokenizer, [call("calculator", expression="2**")]), calc_task, tiny_tokenizer)
    assert trajectory.steps == calc_task.max_steps and trajectory.tool_calls_ok == 0
    assert trajectory.reward.failure is FailureClass.TOOL_ERROR and trajectory.metadata["final_answer"] is None


def test_truncated_turn_ends_the_episode(tiny_tokenizer, calc_task):
    long_turn = call("calculator", expression=calc_task.metadata["expression"])
    trajectory = run(ScriptedEngine(tiny_tokenizer, [long_turn]), calc_task, tiny_tokenizer,
                     sampling=SamplingParams(max_new_tokens=5))
    assert trajectory.truncated and trajectory.steps == 1 and trajectory.tool_calls == 0  # a cut turn is not run
    assert trajectory.reward.failure is FailureClass.TRUNCATED and not trajectory.reward.passed
    assert trajectory.metadata["finish_reasons"] == ["length"]


def test_context_limit_truncates(tiny_tokenizer, calc_task):
    script = [call("calculator", expression=calc_task.metadata["expression"]), answer_of(calc_task) + END]
    engine = ScriptedEngine(tiny_tokenizer, script)
    full = run(engine, calc_task, tiny_tokenizer)
    limit = full.prompt_length + len(engine.returned[calc_task.id][0]) + 2  # room for turn 1, not for turn 2
    trajectory = run(ScriptedEngine(tiny_tokenizer, script), calc_task, tiny_tokenizer, max_context_tokens=limit)
    assert trajectory.truncated and trajectory.reward.failure is FailureClass.TRUNCATED
    assert trajectory.steps == 1 and trajectory.tool_calls_ok == 1


def test_episode_timeout(tiny_tokenizer, calc_task):
    @tool("slow_calculator", "A calculator that takes a second.", {"type": "object", "properties": {}})
    async def slow_calculator(ctx):
        await asyncio.sleep(1.0)
        return "6"

    calc_task.timeout_s, calc_task.tools = 0.3, ["slow_calculator"]
    script = [call("slow_calculator"), answer_of(calc_task) + END]
    trajectory = run(ScriptedEngine(tiny_tokenizer, script), calc_task, tiny_tokenizer)
    assert trajectory.wall_s < 0.9  # the episode did not wait for the slow tool
    assert trajectory.reward.failure is FailureClass.TIMEOUT and trajectory.metadata["timed_out"]
    assert trajectory.steps == 1 and not trajectory.reward.is_infrastructure_failure


def test_waiting_for_the_engine_is_not_the_models_timeout(tiny_tokenizer, calc_task):
    """A turn that waits in the engine's queue (a busy machine, a long batch) longer than the task's timeout is
    judged on what the model wrote: the timeout bounds the environment's time, a turn is bounded by its tokens."""
    calc_task.timeout_s = 0.3
    script = [call("calculator", expression=calc_task.metadata["expression"]), answer_of(calc_task) + END]
    engine = ScriptedEngine(tiny_tokenizer, script, delay_s={0: 0.5, 1: 0.5})  # each turn waits 0.5 s
    trajectory = run(engine, calc_task, tiny_tokenizer)
    assert trajectory.wall_s > 1.0 and trajectory.steps == 2
    assert trajectory.reward.passed and trajectory.reward.failure is FailureClass.NONE
    assert not trajectory.metadata["timed_out"]


def test_engine_failure_is_infra_never_a_trainable_zero(tiny_tokenizer, calc_task):
    script = [call("calculator", expression="2*3"), "6" + END]
    trajectory = run(ScriptedEngine(tiny_tokenizer, script, fail_on_turn=1), calc_task, tiny_tokenizer,
                     infra_retries=1)
    assert trajectory.reward.failure is FailureClass.INFRA and trajectory.reward.is_infrastructure_failure
    assert "illegal memory access" in trajectory.reward.details["error"]
    assert trajectory.metadata["attempts"] == 2
    assert sum(trajectory.loss_mask) == 0 and trajectory.metadata["policy_tokens_before_masking"] > 0
    assert rollout_stats([trajectory])["infra_failures"] == 1


def test_sandbox_failure_in_a_tool_is_a_sandbox_failure(tiny_tokenizer, calc_task):
    @tool("flaky_jail", "A tool whose jail cannot start.")
    def flaky_jail(ctx):
        raise ToolInfraError("bwrap: setting up uid map: Permission denied")

    calc_task.tools = ["calculator", "flaky_jail"]
    trajectory = run(ScriptedEngine(tiny_tokenizer, [call("flaky_jail"), "6" + END]), calc_task, tiny_tokenizer)
    assert trajectory.reward.failure is FailureClass.SANDBOX and trajectory.reward.is_infrastructure_failure
    assert sum(trajectory.loss_mask) == 0


def test_verifier_crash_is_infra(tiny_tokenizer, calc_task):
    from posttrain.verify import register_verifier

    def broken(completion, *, final_state=None):
        raise ZeroDivisionError("verifier bug")

    register_verifier("test_envs_broken", broken, replace=True)
    calc_task.verifier, calc_task.verifier_args = "test_envs_broken", {}
    trajectory = run(ScriptedEngine(tiny_tokenizer, ["6" + END]), calc_task, tiny_tokenizer)
    assert trajectory.reward.failure is FailureClass.INFRA


@pytest.mark.parametrize("blocking", [True, False])
def test_only_a_blocking_verifier_leaves_the_event_loop_thread(tiny_tokenizer, calc_task, blocking):
    import threading

    from posttrain.types import Reward
    from posttrain.verify import is_blocking, register_verifier

    threads = []

    def recording(completion, *, final_state=None):
        threads.append(threading.get_ident())
        return Reward(1.0, True)

    name = f"test_envs_thread_{blocking}"
    register_verifier(name, recording, replace=True, blocking=blocking)
    calc_task.verifier, calc_task.verifier_args = name, {}
    trajectory = run(ScriptedEngine(tiny_tokenizer, ["6" + END]), calc_task, tiny_tokenizer)
    assert trajectory.reward.passed and is_blocking(name) is blocking
    assert (threads == [threading.get_ident()]) is not blocking  # asyncio.run's loop runs on this thread
    assert not is_blocking("exact") and not is_blocking("structured") and is_blocking("code") and is_blocking("math")


def test_unknown_environment_is_infra_with_a_clear_error(tiny_tokenizer, calc_task):
    calc_task.env = "chess"
    trajectory = run(ScriptedEngine(tiny_tokenizer, ["6" + END]), calc_task, tiny_tokenizer)
    assert trajectory.reward.failure is FailureClass.INFRA
    assert "unknown environment 'chess'" in trajectory.reward.details["error"]


def test_step_cost_is_a_reward_component(tiny_tokenizer, calc_task):
    calc_task.env_args["step_cost"] = 0.1
    script = [call("calculator", expression=calc_task.metadata["expression"]), answer_of(calc_task) + END]
    trajectory = run(ScriptedEngine(tiny_tokenizer, script), calc_task, tiny_tokenizer)
    assert trajectory.reward.score == 1.0 and trajectory.reward.components["step_cost"] == pytest.approx(-0.1)


def test_many_episodes_run_concurrently_in_one_event_loop(tiny_tokenizer):
    tasks = sample_tasks(get_domain("calculator"), 20, level=1, seed=2)
    scripts = {t.id: [call("calculator", expression=t.metadata["expression"]), answer_of(t) + END] for t in tasks}
    policy = GatedPolicy(ScriptedEngine(tiny_tokenizer, scripts), expected=80)
    trajectories = asyncio.run(rollout_many(policy, tasks, tiny_tokenizer, SAMPLING, n=4))
    assert len(trajectories) == 80 and all(t.reward.passed for t in trajectories)
    # Every episode waited on the engine at the same time: all 80 had started before any reached its last turn.
    assert policy.gate.is_set() and policy.waiting_when_opened == 80
    kinds = [kind for kind, _ in policy.events]
    assert kinds == ["start"] * 80 + ["end"] * 80
    assert Counter(policy.events) == {(kind, t.id): 4 for t in tasks for kind in ("start", "end")}  # 4 a group
    assert [t.task_id for t in trajectories[:4]] == [tasks[0].id] * 4 and len({t.group_id for t in trajectories}) == 20
    stats = rollout_stats(trajectories)
    assert stats["episodes"] == 80 and stats["passed"] == 80 and stats["tool_calls_ok"] == 80


def test_episodes_run_one_at_a_time_do_not_open_the_gate(tiny_tokenizer, calc_task):
    """The check above fails for a loop that runs episodes serially (here: one episode at a time)."""
    script = [call("calculator", expression=calc_task.metadata["expression"]), answer_of(calc_task) + END]
    policy = GatedPolicy(ScriptedEngine(tiny_tokenizer, script), expected=2, patience_s=0.2)
    trajectories = asyncio.run(rollout_many(policy, [calc_task] * 2, tiny_tokenizer, SAMPLING, max_concurrency=1))
    assert not policy.gate.is_set() and all(t.reward.is_infrastructure_failure for t in trajectories)


def test_bounded_concurrency_and_groups(tiny_tokenizer, calc_task):
    script = [call("calculator", expression=calc_task.metadata["expression"]), answer_of(calc_task) + END]
    policy = SlowAsyncPolicy(ScriptedEngine(tiny_tokenizer, script), delay_s=0.01)
    trajectories = asyncio.run(rollout_many(policy, [calc_task] * 3, tiny_tokenizer, SAMPLING, n=2, max_concurrency=2))
    assert policy.max_in_flight <= 2 and len(trajectories) == 6
    group = asyncio.run(rollout_group(policy, calc_task, tiny_tokenizer, SamplingParams(seed=3), n=3))
    assert len({t.group_id for t in group}) == 1 and all(t.reward.passed for t in group)


def test_sync_engine_requests_are_batched_and_a_bad_request_fails_alone(tiny_tokenizer):
    tasks = sample_tasks(get_domain("calculator"), 12, level=1, seed=8)
    scripts = {t.id: [call("calculator", expression=t.metadata["expression"]), answer_of(t) + END] for t in tasks}

    class OneBadTask(ScriptedEngine):
        def generate(self, requests, sampling):
            if any(r.request_id.startswith(tasks[3].id) for r in requests):
                self.calls.append(len(requests))
                raise ValueError("prompt too long for the KV cache")
            return super().generate(requests, sampling)

    engine = OneBadTask(tiny_tokenizer, scripts)
    trajectories = run_episodes(engine, tasks, tiny_tokenizer, SAMPLING, n=2)
    # Every episode's first turn in one call; it fails, so its 24 requests are retried one by one; then the 22
    # good episodes' second turns, batched again (those that arrived during the retries, then the rest).
    assert engine.calls[0] == 24 and engine.calls[1:25] == [1] * 24
    assert sum(engine.calls[25:]) == 22 and len(engine.calls[25:]) <= 2
    failed = [t for t in trajectories if not t.reward.passed]
    assert {t.task_id for t in failed} == {tasks[3].id} and all(t.reward.failure is FailureClass.INFRA for t in failed)


def test_sync_engines_are_adapted_and_run_from_sync_code(tiny_tokenizer, calc_task):
    engine = ScriptedEngine(tiny_tokenizer, [call("calculator", expression=calc_task.metadata["expression"]),
                                             answer_of(calc_task) + END])
    assert isinstance(as_policy(engine), SyncEnginePolicy)
    policy = SlowAsyncPolicy(engine)
    assert as_policy(policy) is policy
    [trajectory] = run_episodes(engine, [calc_task], tiny_tokenizer, SAMPLING)
    assert trajectory.reward.passed
    with pytest.raises(TypeError, match="generate"):
        as_policy(object())


def test_a_template_that_rewrites_history_is_refused(tiny_tokenizer, calc_task):
    from posttrain.envs import TranscriptTokens

    class Rewriting:
        eos_token, eos_token_id = END, tiny_tokenizer.eos_token_id

        def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=False):
            return f"[{len(messages)} messages]"

        def encode(self, text, add_special_tokens=False):
            return tiny_tokenizer.encode(text, add_special_tokens=False)

        def decode(self, ids, skip_special_tokens=False):
            return tiny_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    tokens = TranscriptTokens(Rewriting(), calc_task.messages)
    [[completion]] = ScriptedEngine(tiny_tokenizer, ["x" + END]).generate(
        [type("R", (), {"request_id": "t:0", "prompt_token_ids": [1]})()], SAMPLING)
    tokens.add_policy_turn(completion, {"role": "assistant", "content": "x"})
    with pytest.raises(EnvError, match="prefix-stable"):
        tokens.add_observation([{"role": "tool", "content": "1"}])


def test_prompt_ids_are_cached_per_tokenizer_and_template(tiny_tokenizer, calc_task):
    import copy

    from posttrain.envs import TranscriptTokens

    tokenizer = copy.deepcopy(tiny_tokenizer)
    renders = []
    render = tokenizer.apply_chat_template

    def counting(*args, **kwargs):
        renders.append(1)
        return render(*args, **kwargs)

    tokenizer.apply_chat_template = counting
    first = TranscriptTokens(tokenizer, calc_task.messages)
    again = TranscriptTokens(tokenizer, calc_task.messages)  # a group member: same prompt, from the cache
    assert again.token_ids == first.token_ids and again.prompt_length == first.prompt_length and len(renders) == 1
    again.token_ids.append(0)  # a transcript's own list: the cached ids stay as they were
    assert TranscriptTokens(tokenizer, calc_task.messages).token_ids == first.token_ids
    other = [{**calc_task.messages[-1], "content": calc_task.messages[-1]["content"] + " now"}]
    assert TranscriptTokens(tokenizer, calc_task.messages[:-1] + other).token_ids != first.token_ids
    tokenizer.chat_template = tokenizer.chat_template.replace("<|", "<<|")  # a new template: rendered anew
    assert len(TranscriptTokens(tokenizer, calc_task.messages).token_ids) > len(first.token_ids)


def test_template_with_text_after_end_of_turn(tiny_tokenizer, calc_task):
    # Qwen/ChatML-style: a newline follows every end-of-turn token, and the model stops at the token itself.
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ {'name': c['function']['name'], "
        "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    assert "<|end|>\n" in tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    script = [call("calculator", expression=calc_task.metadata["expression"]), answer_of(calc_task) + END]
    trajectory = run(ScriptedEngine(tokenizer, script), calc_task, tokenizer)
    assert trajectory.reward.passed
    rendered = tokenizer.apply_chat_template(trajectory.messages, tokenize=False)
    assert tokenizer.decode(trajectory.token_ids, skip_special_tokens=False) + "\n" == rendered
    observation = [i for i, m in enumerate(trajectory.loss_mask) if not m and i >= trajectory.prompt_length]
    assert tokenizer.decode([trajectory.token_ids[i] for i in observation]).startswith("\n<|tool|>")


def test_judging_time_is_recorded_and_concurrent_judgements_count_once(tiny_tokenizer):
    from posttrain.envs import judging_wall_seconds
    from posttrain.types import Reward, Trajectory

    task = sample_tasks(get_domain("code"), 1, level=1, seed=2)[0]
    started = time.monotonic()
    answer = f"```python\n{task.metadata['solution']}\n```{END}"
    trajectory = run(ScriptedEngine(tiny_tokenizer, [answer]), task, tiny_tokenizer,
                     sampling=SamplingParams(max_new_tokens=1024, temperature=0.0))
    assert trajectory.reward.passed  # judged in the sandbox
    start, end = trajectory.metadata["judge_window"]
    assert started <= start < end <= time.monotonic() and trajectory.metadata["judge_s"] == pytest.approx(end - start)

    def judged(*window):
        return Trajectory("t", "code", [], [], [], [], 0, Reward(score=0.0, passed=False),
                          metadata={"judge_window": list(window)})

    # [0, 2] and [1, 3] overlap (3 s of wall time, not 4), [5, 6] stands alone, one episode was never judged
    batch = [judged(1.0, 3.0), judged(5.0, 6.0), judged(0.0, 2.0), judged(1.5, 2.5),
             Trajectory("u", "code", [], [], [], [], 0, Reward(score=0.0, passed=False))]
    assert judging_wall_seconds(batch) == pytest.approx(4.0)
    assert judging_wall_seconds([]) == 0.0
