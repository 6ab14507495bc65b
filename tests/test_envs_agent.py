"""Black-box agents: programs written with the official `openai` client, run in bubblewrap against the recording
endpoint of a tiny model (or a scripted policy), judged on their final state, their calls recorded token-exactly."""

from __future__ import annotations

import asyncio
import json
import socket
import textwrap
import threading

import pytest
from test_envs_scripted import GatedPolicy, ScriptedEngine
from test_envs_tools import needs_bwrap

from posttrain.envs import EndpointLimits, RecordingEndpoint, as_policy, rollout_episode
from posttrain.types import FailureClass, Reward, SamplingParams, Task, Trajectory
from posttrain.verify import register_verifier

END = "<|end|>"
SAMPLING = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

# A multi-turn tool loop as people write them: call the model with tools, run the calls it makes, send the
# results back (echoing the assistant message as the client returned it), ask again when it made none.
TOOL_LOOP_AGENT = textwrap.dedent('''
    import json, os, sys
    from openai import OpenAI

    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the episode
    task = json.load(open(os.environ["POSTTRAIN_TASK"]))
    messages = list(task["messages"])
    tools = json.loads(sys.argv[1])
    turns, crash_after = int(sys.argv[2]), int(sys.argv[3])
    for turn in range(turns):
        reply = client.chat.completions.create(model="anything", messages=messages, tools=tools, max_tokens=12)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if turn + 1 == crash_after:
            raise RuntimeError("the agent's own bug, half way through")
        if message.tool_calls:
            for call in message.tool_calls:
                expression = json.loads(call.function.arguments)["expression"]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(eval(expression, {}))})
        else:
            messages.append({"role": "user", "content": "Use the calculator, then answer."})
    with open("answer.txt", "w") as handle:
        handle.write(str(6 * 7))
    print("done after", turns, "calls")
''')


def _answer_file_verifier(completion: str, expected: str, *, final_state=None) -> Reward:
    """Judges the agent's work dir, never what it printed."""
    files = (final_state or {}).get("files") or {}
    found = files.get("answer.txt", "").strip()
    passed = found == expected
    return Reward(float(passed), passed, FailureClass.NONE if passed else FailureClass.WRONG_ANSWER,
                  details={"found": found})


register_verifier("test_answer_file", _answer_file_verifier, replace=True, blocking=False)


class RecordingEngine:
    """A real engine, with every request and completion it served kept for the assertions."""

    def __init__(self, engine):
        self.engine = engine
        self.served: list[tuple[list[int], object]] = []

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def update_weights(self, state, version: int) -> None:
        self.engine.update_weights(state, version)

    def generate(self, requests, sampling):
        results = self.engine.generate(requests, sampling)
        for request, completions in zip(requests, results):
            self.served.append((list(request.prompt_token_ids), completions[0]))
        return results


def _task(script, tools, turns: int, crash_after: int = 0, expected: str = "42", **env_args) -> Task:
    command = ["{python}", str(script), json.dumps(tools), str(turns), str(crash_after)]
    return Task(id="agent-1", domain="agent", messages=[{"role": "user", "content": "What is 6*7?"}],
                verifier="test_answer_file", verifier_args={"expected": expected}, env="agent",
                env_args={"command": command, **env_args}, timeout_s=90)


@pytest.fixture()
def tiny_engine(tiny_model, tiny_tokenizer):
    from posttrain.rollout import HFEngine

    return RecordingEngine(HFEngine(tiny_model, tiny_tokenizer, policy_version=5))


def _run(engine, task, tokenizer):
    return asyncio.run(rollout_episode(engine, task, tokenizer, SAMPLING))


def _tool_loop(tmp_path, engine, tokenizer, turns: int, **task_args):
    """One episode of the openai-client tool loop agent."""
    script = tmp_path / "agent.py"
    script.write_text(TOOL_LOOP_AGENT)
    return _run(engine, _task(script, [CALCULATOR], turns=turns, **task_args), tokenizer)


@needs_bwrap
@pytest.mark.bwrap
def test_openai_tool_loop_agent_is_recorded_token_exactly(tmp_path, tiny_engine, tiny_tokenizer):
    trajectory = _tool_loop(tmp_path, tiny_engine, tiny_tokenizer, turns=3)

    assert trajectory.reward.passed and trajectory.reward.failure is FailureClass.NONE, trajectory.reward
    report = trajectory.metadata["agent"]
    assert (trajectory.steps, report["calls"], report["segments"], report["exit_code"]) == (3, 3, 1, 0)
    assert "done after 3 calls" in trajectory.metadata["final_answer"]
    served = tiny_engine.served
    assert len(served) == 3
    ids, mask = trajectory.token_ids, trajectory.loss_mask
    # Every call's prompt is the trajectory so far, and its completion follows it verbatim: one sequence.
    for prompt, completion in served:
        end = len(prompt) + len(completion.token_ids)
        assert ids[:len(prompt)] == prompt
        assert ids[len(prompt):end] == completion.token_ids
        assert mask[len(prompt):end] == [1] * len(completion.token_ids)
        assert trajectory.behaviour_logprobs[len(prompt):end] == completion.logprobs
        assert set(trajectory.policy_versions[len(prompt):end]) == {5}
    # The policy's tokens are exactly the sampled ones; the agent's messages between them are masked observations.
    assert [t for t, m in zip(ids, mask) if m] == [t for _, c in served for t in c.token_ids]
    first_end = len(served[0][0]) + len(served[0][1].token_ids)
    assert len(served[1][0]) > first_end and set(mask[first_end:len(served[1][0])]) == {0}


@needs_bwrap
@pytest.mark.bwrap
def test_wrong_final_state_is_the_models_failure_not_infra(tmp_path, tiny_engine, tiny_tokenizer):
    trajectory = _tool_loop(tmp_path, tiny_engine, tiny_tokenizer, turns=1, expected="41")

    assert trajectory.reward.failure is FailureClass.WRONG_ANSWER and trajectory.reward.score == 0.0
    assert not trajectory.reward.is_infrastructure_failure and trajectory.policy_tokens > 0


@needs_bwrap
@pytest.mark.bwrap
def test_agent_that_crashes_half_way_is_an_infrastructure_failure(tmp_path, tiny_engine, tiny_tokenizer):
    trajectory = _tool_loop(tmp_path, tiny_engine, tiny_tokenizer, turns=4, crash_after=2)

    assert trajectory.reward.failure is FailureClass.INFRA and trajectory.reward.is_infrastructure_failure
    assert "the agent's own bug" in trajectory.reward.details["error"]
    assert trajectory.metadata["agent"]["calls"] == 2 and len(tiny_engine.served) == 2
    # Recorded, then masked: nothing of a crashed episode is trained on.
    assert trajectory.metadata["policy_tokens_before_masking"] > 0 and sum(trajectory.loss_mask) == 0


@needs_bwrap
@pytest.mark.bwrap
def test_call_limit_is_the_models_truncation_not_infra(tmp_path, tiny_engine, tiny_tokenizer):
    trajectory = _tool_loop(tmp_path, tiny_engine, tiny_tokenizer, turns=5, max_calls=2)

    assert trajectory.metadata["agent"]["limit_hit"] == "calls" and trajectory.steps == 2
    assert trajectory.reward.failure is FailureClass.TRUNCATED and not trajectory.reward.is_infrastructure_failure


@needs_bwrap
@pytest.mark.bwrap
def test_shipped_agent_runs_the_policys_tool_calls_and_is_judged_on_its_answer(tiny_tokenizer):
    """The recipe's agent (data/blackbox_agent.py) with a scripted policy that calls the calculator, then answers
    with the tool's result: the calls come back as OpenAI tool_calls, the echoed history continues one segment."""
    import re
    from pathlib import Path

    from posttrain.tasks import get_domain, sample_tasks

    agent = Path(__file__).resolve().parents[1] / "src" / "posttrain" / "recipes" / "data" / "blackbox_agent.py"
    domain = get_domain("agent", command=["{python}", str(agent), "3"], tasks={"name": "calculator"}, max_calls=3)
    task = sample_tasks(domain, 1, level=1, seed=2)[0]

    def policy_turn(prompt: str, turn: int) -> str:
        if turn == 0:
            expression = re.search(r"What is ([0-9*]+)\?", prompt).group(1)
            return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>%s' % (
                expression, END)
        return re.findall(r"[0-9]+", prompt)[-1] + END  # the tool's result, the last number shown

    trajectory = asyncio.run(rollout_episode(ScriptedEngine(tiny_tokenizer, policy_turn), task, tiny_tokenizer,
                                             SamplingParams(max_new_tokens=64)))
    report = trajectory.metadata["agent"]
    assert trajectory.reward.passed, (trajectory.reward, report)
    assert (report["calls"], report["segments"], trajectory.steps) == (2, 1, 2)
    assert [m["role"] for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]
    assert trajectory.messages[1]["tool_calls"][0]["function"]["name"] == "calculator"


@needs_bwrap
@pytest.mark.bwrap
def test_agents_wait_on_the_model_together_in_jails_of_their_own(tiny_tokenizer):
    """`jails: 6`: six episodes of the shipped plain-HTTP agent have their calls waiting on the policy at once (the
    shared pool has a slot per CPU, so without the option only that many could), each judged by its task."""
    from pathlib import Path

    from posttrain.envs import rollout_many
    from posttrain.tasks import TaskError, get_domain, sample_tasks

    recipes = Path(__file__).resolve().parents[1] / "src" / "posttrain" / "recipes"
    inner = {"name": "verifiers", "args": {"taskset": str(recipes / "env_digits.py"), "pass_threshold": 1.0}}
    domain = get_domain("agent", command=["{python}", str(recipes / "data" / "http_agent.py")], tasks=inner,
                        max_calls=1, jails=6)
    tasks = sample_tasks(domain, 6, level=1, seed=0)
    policy = GatedPolicy(ScriptedEngine(tiny_tokenizer, ["123" + END]), expected=6, patience_s=120.0)
    trajectories = asyncio.run(rollout_many(policy, tasks, tiny_tokenizer, SAMPLING))
    assert policy.gate.is_set() and policy.waiting_when_opened == 6
    assert all(t.reward.passed and t.metadata["agent"]["calls"] == 1 for t in trajectories), [
        (t.reward, t.metadata.get("agent")) for t in trajectories]
    with pytest.raises(TaskError, match="jails must be a positive integer"):
        get_domain("agent", command=["{python}", str(recipes / "data" / "http_agent.py")], tasks=inner, jails=0)


# An agent that rewrites its history: the first exchange is replaced by a summary (a new segment), which the next
# call then continues. Three calls, two segments: [call 1], [call 2, call 3].
REWRITING_AGENT = textwrap.dedent('''
    import json, os
    from openai import OpenAI

    client = OpenAI(max_retries=0)
    question = json.load(open(os.environ["POSTTRAIN_TASK"]))["messages"][-1]["content"]
    draft = client.chat.completions.create(model="p", messages=[{"role": "user", "content": question}], max_tokens=8)
    messages = [{"role": "user", "content": "Earlier you drafted %d characters. " % len(
        draft.choices[0].message.content or "") + question}]
    reply = client.chat.completions.create(model="p", messages=messages, max_tokens=8)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    final = client.chat.completions.create(model="p", messages=messages, max_tokens=8)
    print(final.choices[0].message.content)
''')


def _rewriting_episode(tmp_path, engine, tokenizer):
    """One episode of `REWRITING_AGENT` on "What is 6*7?"."""
    script = tmp_path / "rewriter.py"
    script.write_text(REWRITING_AGENT)
    task = Task(id="rewrite-1", domain="agent", messages=[{"role": "user", "content": "What is 6*7?"}],
                verifier="exact", verifier_args={"answer": "42"}, env="agent",
                env_args={"command": ["{python}", str(script)]}, timeout_s=600)
    return _run(engine, task, tokenizer)


def _policy_runs(trajectory) -> list[list[int]]:
    """The trajectory's policy tokens as runs of consecutive sampled ids (one per call)."""
    runs, previous = [], 0
    for token, mask in zip(trajectory.token_ids, trajectory.loss_mask):
        if mask and not previous:
            runs.append([])
        if mask:
            runs[-1].append(token)
        previous = mask
    return runs


def _assert_rows_are_the_sampled_calls(rows, served) -> None:
    """Each row's policy tokens are served completions, verbatim and with their logprobs; each row's prompt is
    what the engine was given for the row's first call."""
    by_ids = {tuple(c.token_ids): (prompt, c) for prompt, c in served}
    for row in rows:
        runs = _policy_runs(row)
        assert runs and all(tuple(run) in by_ids for run in runs), "a row holds tokens the engine never sampled"
        first_prompt = by_ids[tuple(runs[0])][0]
        assert row.token_ids[:len(first_prompt)] == first_prompt
        sampled = [lp for lp, m in zip(row.behaviour_logprobs, row.loss_mask) if m]
        assert sampled == [lp for run in runs for lp in by_ids[tuple(run)][1].logprobs]


@needs_bwrap
@pytest.mark.bwrap
def test_every_segment_of_an_agent_that_rewrites_its_history_is_trained_on(tmp_path, tiny_engine, tiny_tokenizer):
    import torch

    from posttrain.envs import trajectory_segments
    from posttrain.rl.update import collate_trajectories

    trajectory = _rewriting_episode(tmp_path, tiny_engine, tiny_tokenizer)

    report = trajectory.metadata["agent"]
    assert not trajectory.reward.is_infrastructure_failure, trajectory.reward
    assert (report["calls"], report["segments"]) == (3, 2)
    served = tiny_engine.served
    rows = trajectory_segments(trajectory)
    assert len(rows) == 2 and [r.steps for r in rows] == [1, 2]
    assert all(r.reward is trajectory.reward and r.group_id == trajectory.group_id for r in rows)
    # Segment 1 is call 1 alone; segment 2 is calls 2 and 3 (call 3's prompt extends call 2's sampled ids).
    assert _policy_runs(rows[0]) == [served[0][1].token_ids]
    assert _policy_runs(rows[1]) == [served[1][1].token_ids, served[2][1].token_ids]
    _assert_rows_are_the_sampled_calls(rows, served)
    # The trainer's micro-batch: every call's sampled ids are targets, with their behaviour logprobs, and both
    # segments carry the episode's advantage.
    micro = collate_trajectories(rows, [0.75, 0.75], pad_id=0, device=torch.device("cpu"))
    assert micro.targets.tolist() == [t for _, c in served for t in c.token_ids]
    assert micro.behaviour.tolist() == pytest.approx([lp for _, c in served for lp in c.logprobs], abs=0)
    assert set(micro.advantages.tolist()) == {0.75} and set(micro.seq_index.tolist()) == {0, 1}


def _select(trajectory, step: int, max_staleness: int, stale: str = "drop"):
    from posttrain.config import RLRecipe
    from posttrain.rl.pipeline import select_trainable

    recipe = RLRecipe.model_validate({"pipeline": {"max_staleness": max_staleness, "stale": stale}})
    return select_trainable([trajectory], step, recipe)


def test_an_agent_episode_is_as_stale_as_its_oldest_segment():
    """Staleness is the episode's: a segment sampled before a weight update makes the whole episode that old,
    though its own (last) sequence is fresh. Hand-built in the format `AgentEnv` reports (`earlier_segments`)."""
    from posttrain.envs import oldest_policy_version

    def segment(version: int) -> dict:
        return {"token_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "behaviour_logprobs": [0.0, 0.0, -0.5, -0.25],
                "policy_versions": [-1, -1, version, version], "prompt_length": 2, "calls": 1, "messages": []}

    last = segment(6)
    trajectory = Trajectory(
        task_id="t", domain="agent", token_ids=last["token_ids"], loss_mask=last["loss_mask"],
        behaviour_logprobs=last["behaviour_logprobs"], policy_versions=last["policy_versions"], prompt_length=2,
        reward=Reward(1.0, True), steps=2, metadata={"agent": {"earlier_segments": [segment(3)]}})
    assert trajectory.min_policy_version == 6 and oldest_policy_version(trajectory) == 3
    assert _select(trajectory, step=7, max_staleness=1) == ([], {**_counts(), "stale_dropped": 1})
    assert _select(trajectory, step=7, max_staleness=4) == ([trajectory], _counts())
    assert _select(trajectory, step=7, max_staleness=1, stale="reweight") == ([trajectory],
                                                                              {**_counts(), "stale_kept": 1})


def test_an_agent_episode_pays_the_token_cost_of_every_segment():
    """The return's token cost and the rollout metrics count the tokens the policy sampled in the whole episode:
    a black-box agent's earlier segments (trained on) are not free."""
    from posttrain.config import ReturnConfig
    from posttrain.envs import episode_policy_tokens
    from posttrain.rl.advantages import episode_return
    from posttrain.rl.pipeline import batch_metrics

    def segment(sampled: int) -> dict:
        return {"token_ids": [1, 2] + [3] * sampled, "loss_mask": [0, 0] + [1] * sampled,
                "behaviour_logprobs": [0.0] * (2 + sampled), "policy_versions": [-1, -1] + [0] * sampled,
                "prompt_length": 2, "calls": 1, "messages": []}

    last = segment(2)
    trajectory = Trajectory(
        task_id="t", domain="agent", token_ids=last["token_ids"], loss_mask=last["loss_mask"],
        behaviour_logprobs=last["behaviour_logprobs"], policy_versions=last["policy_versions"], prompt_length=2,
        reward=Reward(1.0, True), steps=3, metadata={"agent": {"earlier_segments": [segment(5), segment(3)]}})
    assert trajectory.policy_tokens == 2 and episode_policy_tokens(trajectory) == 10
    _, components = episode_return(trajectory, ReturnConfig(token_cost=0.01), max_new_tokens=16)
    assert components["token_cost"] == pytest.approx(-0.10)
    assert batch_metrics([trajectory])["rollout/policy_tokens"] == 10


def _counts() -> dict[str, int]:
    return {"episodes": 1, "infra_masked": 0, "filtered": 0, "stale_dropped": 0, "stale_kept": 0}


@needs_bwrap
@pytest.mark.bwrap
def test_a_stale_earlier_segment_of_a_real_agent_episode_is_caught(tmp_path, tiny_tokenizer):
    """The history-rewriting agent against a policy whose weights are updated after its first call (version 7,
    then 9): the first segment is two versions older than the last, and the trainer's selection sees it."""
    from posttrain.envs import oldest_policy_version, trajectory_segments

    def policy_turn(prompt: str, turn: int) -> str:
        if turn == 1:
            engine.update_weights(None, 9)  # a weight update between the agent's first and second call
        return f"draft {turn}{END}"

    engine = ScriptedEngine(tiny_tokenizer, policy_turn, version=7)
    trajectory = _rewriting_episode(tmp_path, engine, tiny_tokenizer)

    assert not trajectory.reward.is_infrastructure_failure, trajectory.reward
    assert trajectory.metadata["agent"]["segments"] == 2
    assert [r.min_policy_version for r in trajectory_segments(trajectory)] == [7, 9]
    assert trajectory.min_policy_version == 9 and oldest_policy_version(trajectory) == 7
    # At step 10 with max_staleness 1 the last segment alone (10 - 9 = 1) would pass; the first (10 - 7) does not.
    kept, counts = _select(trajectory, step=10, max_staleness=1)
    assert kept == [] and counts["stale_dropped"] == 1
    kept, counts = _select(trajectory, step=10, max_staleness=3)
    assert kept == [trajectory] and counts["stale_dropped"] == 0


class RemotePool:
    """A pool whose runs would happen on another machine (as Ray's sandbox workers): it must never get a jail."""

    def __init__(self):
        self.runs = 0

    def execute(self, request):
        self.runs += 1
        raise AssertionError("an agent's jail was sent away from its endpoint")

    async def aexecute(self, request):
        return self.execute(request)


@needs_bwrap
@pytest.mark.bwrap
def test_an_agent_runs_beside_its_endpoint_when_the_sandbox_pool_is_remote(tmp_path, tiny_tokenizer):
    from posttrain.sandbox import Sandbox

    script = tmp_path / "one_call.py"
    script.write_text("from openai import OpenAI\nreply = OpenAI(max_retries=0).chat.completions.create(\n"
                      "    model='p', messages=[{'role': 'user', 'content': 'hi'}])\n"
                      "print(reply.choices[0].message.content)\n")
    remote = RemotePool()
    task = Task(id="beside", domain="agent", messages=[{"role": "user", "content": "hi"}], verifier="exact",
                verifier_args={"answer": "42"}, env="agent", env_args={"command": ["{python}", str(script)]},
                timeout_s=600)
    trajectory = asyncio.run(rollout_episode(ScriptedEngine(tiny_tokenizer, ["42" + END]), task, tiny_tokenizer,
                                             SAMPLING, Sandbox(pool=remote)))
    assert trajectory.reward.passed, trajectory.reward
    assert remote.runs == 0 and trajectory.metadata["agent"]["exit_code"] == 0


NETWORK_PROBE = textwrap.dedent('''
    import os, socket, sys, urllib.request
    results = []
    for host, port in [("127.0.0.1", int(sys.argv[1])), (sys.argv[2], int(sys.argv[1])), ("1.1.1.1", 443)]:
        try:
            socket.create_connection((host, port), timeout=2).close()
            results.append(f"{host}:reached")
        except OSError as error:
            results.append(f"{host}:{type(error).__name__}")
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/models",
                                     headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    results.append("endpoint:" + str(urllib.request.urlopen(request, timeout=5).status))
    print(" ".join(results))
''')


def _host_address() -> str:
    """An address of this machine other than loopback (the jail must not reach it either)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.2"


@needs_bwrap
@pytest.mark.bwrap
def test_the_jail_reaches_only_its_endpoint(tmp_path, tiny_tokenizer):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", 0))
    server.listen(8)
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    script = tmp_path / "probe.py"
    script.write_text(NETWORK_PROBE)
    port, host = server.getsockname()[1], _host_address()
    task = Task(id="probe", domain="agent", messages=[{"role": "user", "content": "hi"}], verifier="exact",
                verifier_args={"answer": "unused"}, env="agent",
                env_args={"command": ["{python}", str(script), str(port), host]}, timeout_s=60)
    engine = ScriptedEngine(tiny_tokenizer, ["unused" + END])
    trajectory = asyncio.run(rollout_episode(engine, task, tiny_tokenizer, SAMPLING))
    server.close()

    printed = trajectory.metadata["final_answer"]
    assert "endpoint:200" in printed  # the one way out works
    assert "127.0.0.1:ConnectionRefusedError" in printed  # the jail's loopback is its own, not the host's
    assert f"{host}:reached" not in printed and "1.1.1.1:reached" not in printed and not accepted


# ---- the endpoint itself: joining calls into segments, limits, refusals (no jail) --------------------------


def _endpoint(tokenizer, script, **limits) -> RecordingEndpoint:
    engine = ScriptedEngine(tokenizer, script)
    return RecordingEndpoint(as_policy(engine), tokenizer, SamplingParams(max_new_tokens=64),
                             EndpointLimits(**limits), api_key="k")


def _post(endpoint, body) -> tuple[int, dict]:
    status, _, payload = asyncio.run(endpoint.handle("POST", "/v1/chat/completions",
                                                     {"authorization": "Bearer k"}, json.dumps(body).encode()))
    return status, json.loads(payload)


def test_resent_turns_continue_the_segment_with_the_sampled_ids(tiny_tokenizer):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    endpoint = _endpoint(tiny_tokenizer, [call + END, "42" + END])

    async def conversation():
        first = json.loads((await endpoint.handle("POST", "/v1/chat/completions", {"authorization": "Bearer k"},
                                                  json.dumps({"model": "m", "tools": [CALCULATOR], "messages": [
                                                      {"role": "user", "content": "6*7?"}]}).encode()))[2])
        message = first["choices"][0]["message"]
        assert first["choices"][0]["finish_reason"] == "tool_calls"
        assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"expression": "6*7"}
        # the agent re-sends the call with other JSON spacing and its own call id: still the recorded turn
        message["tool_calls"][0]["function"]["arguments"] = '{ "expression" :"6*7" }'
        message["tool_calls"][0]["id"] = "mine"
        second = await endpoint.handle("POST", "/v1/chat/completions", {"authorization": "Bearer k"}, json.dumps({
            "model": "m", "tools": [CALCULATOR], "temperature": 0.2, "messages": [
                {"role": "user", "content": "6*7?"}, message,
                {"role": "tool", "tool_call_id": "mine", "content": "42"}]}).encode())
        return json.loads(second[2])

    second = asyncio.run(conversation())
    assert second["choices"][0]["message"]["content"] == "42"
    assert len(endpoint.segments) == 1 and [c.continued for c in endpoint.calls] == [False, True]
    segment = endpoint.segments[0]
    first_ids = endpoint.calls[0].completion.token_ids
    start = segment.prompt_length
    assert segment.token_ids[start:start + len(first_ids)] == first_ids  # never re-tokenized from the echo
    assert endpoint.calls[1].prompt_token_ids == segment.token_ids[:len(endpoint.calls[1].prompt_token_ids)]
    assert endpoint.ignored_params == {"temperature"}


def test_an_edited_history_starts_a_new_segment(tiny_tokenizer):
    endpoint = _endpoint(tiny_tokenizer, ["one" + END, "two" + END])
    assert _post(endpoint, {"model": "m", "messages": [{"role": "user", "content": "a"}]})[0] == 200
    status, _ = _post(endpoint, {"model": "m", "messages": [{"role": "user", "content": "a, edited"},
                                                            {"role": "assistant", "content": "one"},
                                                            {"role": "user", "content": "b"}]})
    assert status == 200 and len(endpoint.segments) == 2
    assert [c.continued for c in endpoint.calls] == [False, False]


def test_limits_and_unsupported_requests_are_refused_by_name(tiny_tokenizer):
    endpoint = _endpoint(tiny_tokenizer, ["x" * 40 + END], max_calls=1, max_completion_tokens=1000)
    messages = [{"role": "user", "content": "a"}]
    assert _post(endpoint, {"model": "m", "messages": messages, "n": 2})[1]["error"]["message"].startswith("n:")
    assert "tool_choice" in _post(endpoint, {"model": "m", "messages": messages, "tool_choice": "required",
                                             "tools": [CALCULATOR]})[1]["error"]["message"]
    assert "bogus" in _post(endpoint, {"model": "m", "messages": messages, "bogus": 1})[1]["error"]["message"]
    assert _post(endpoint, {"model": "m", "messages": messages, "max_tokens": 5})[1]["usage"]["completion_tokens"] == 5
    status, body = _post(endpoint, {"model": "m", "messages": messages})
    assert status == 400 and body["error"]["code"] == "posttrain_limit" and endpoint.limit_hit == "calls"
    wrong_key = asyncio.run(endpoint.handle("GET", "/v1/models", {"authorization": "Bearer nope"}, b""))
    assert wrong_key[0] == 401


def test_text_that_is_not_unicode_is_refused_by_name(tiny_tokenizer):
    """JSON lets a body escape a lone surrogate (\\ud800), which no tokenizer can encode: a 400 naming where, not a
    crash of the endpoint (an agent crash is an infrastructure failure, masked instead of scored)."""
    endpoint = _endpoint(tiny_tokenizer, ["x" + END, "y" + END])
    in_content = b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800"}]}'
    in_a_tool = (b'{"model": "m", "messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", '
                 b'"function": {"name": "f\\udc80", "parameters": {}}}]}')
    for body, where in [(in_content, "messages.0.content"), (in_a_tool, "tools.0.function.name")]:
        status, _, payload = asyncio.run(endpoint.handle("POST", "/v1/chat/completions", {"authorization": "Bearer k"},
                                                         body))
        assert status == 400 and where in json.loads(payload)["error"]["message"], payload
    assert _post(endpoint, {"model": "m", "messages": [{"role": "user", "content": "a \u00e9 \U0001f600"}]})[0] == 200


# ---- the agent domain ---------------------------------------------------------------------------------------


def test_agent_domain_wraps_another_domains_tasks(tmp_path):
    import random

    from posttrain.tasks import TaskError, get_domain

    script = tmp_path / "agent.py"
    script.write_text("print(1)")
    domain = get_domain("agent", command=["{python}", str(script)], tasks={"name": "calculator"}, max_calls=3)
    inner = get_domain("calculator").make_task(random.Random(0), 2)
    task = domain.make_task(random.Random(0), 2)
    assert (task.env, task.domain, task.messages, task.verifier_args) == ("agent", "agent", inner.messages,
                                                                           inner.verifier_args)
    assert task.env_args["command"] == ["{python}", str(script)] and task.env_args["max_calls"] == 3
    assert task.metadata["problem_key"] == inner.metadata["problem_key"]  # the same train / held-out split
    assert domain.demonstration(task).messages[-1]["content"] == inner.metadata["answer"]
    with pytest.raises(TaskError, match=r"command\[1\]: /nonexistent/agent.py does not exist"):
        get_domain("agent", command=["{python}", "/nonexistent/agent.py"], tasks={"name": "calculator"})
    with pytest.raises(TaskError, match="max_calls must be a positive number"):
        get_domain("agent", command=["true"], tasks={"name": "calculator"}, max_calls=0)
    with pytest.raises(TaskError, match="tasks must be"):
        get_domain("agent", command=["true"], tasks="calculator")


@needs_bwrap
@pytest.mark.bwrap
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpo_agent_blackbox_recipe_runs_one_step(tmp_path, monkeypatch):
    """The packaged recipe end to end: the shipped OpenAI-client agent in jails, judged, one GRPO step."""
    from posttrain.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["rl", "grpo-agent-blackbox", "train.max_steps=1", "rollout.prompts_per_step=1",
                 "rollout.sampling.group_size=2", "model.preset=tiny-1m", "runtime.num_threads=1",
                 f"output_dir={tmp_path / 'run'}"]) == 0
    episodes = [json.loads(line) for line in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    assert episodes and all(e["domain"] == "agent" and e["details"].get("verifier") == "exact" for e in episodes)
    assert not any(e["failure"] in ("infra", "sandbox_failure") for e in episodes)
    assert (tmp_path / "run" / "final" / "config.json").is_file()


def rewriting_agent_recipe(tmp_path, policy_dir, **sections) -> dict:
    """One GRPO step, one prompt x 2 episodes of the history-rewriting agent on calculator tasks."""
    script = tmp_path / "rewriter.py"
    script.write_text(REWRITING_AGENT)
    return {
        "output_dir": str(tmp_path / "run"), "model": {"path": str(policy_dir)},
        "domains": [{"name": "agent", "levels": [1], "heldout": 0, "args": {
            "command": ["{python}", str(script)], "tasks": {"name": "calculator"}, "timeout_s": 900}}],
        "rollout": {"prompts_per_step": 1, "sampling": {"group_size": 2, "max_new_tokens": 8}},
        "train": {"max_steps": 1, "micro_batch_size": 8}, "pipeline": {"self_test": False},
        "schedule": {"guard": {"enabled": False}}, "tracking": {"tensorboard": False, "progress": False},
        **sections}


@needs_bwrap
@pytest.mark.bwrap
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_rl_step_trains_every_segment_of_a_history_rewriting_agent(tmp_path, monkeypatch, policy_dir):
    """One GRPO step of `run_rl` on the history-rewriting agent: the trainer's batch holds each episode's two
    segments -- every call's sampled ids with the engine's logprobs -- and both carry the episode's advantage."""
    from posttrain.config import RLRecipe
    from posttrain.rl import run_rl
    from posttrain.rl import update as rl_update_module
    from posttrain.rollout import HFEngine

    served, batches = [], []
    generate, collate = HFEngine.generate, rl_update_module.collate_trajectories

    def recording_generate(self, requests, sampling, **kwargs):
        results = generate(self, requests, sampling, **kwargs)
        served.extend((list(r.prompt_token_ids), c[0]) for r, c in zip(requests, results))
        return results

    def recording_collate(trajectories, advantages, *args, **kwargs):
        batches.append((list(trajectories), list(advantages)))
        return collate(trajectories, advantages, *args, **kwargs)

    monkeypatch.setattr(HFEngine, "generate", recording_generate)
    monkeypatch.setattr(rl_update_module, "collate_trajectories", recording_collate)
    # every segment must reach the trainer's batch, also of a group whose two episodes score alike (zero advantage)
    result = run_rl(RLRecipe.model_validate(rewriting_agent_recipe(tmp_path, policy_dir, runtime={
        "precision": "fp32", "num_threads": 1}, algorithm={"skip_zero_advantage": False})))

    assert result.history[0]["rollout/sequences"] == 4.0  # two episodes, two segments each
    rows = {id(t): (t, a) for trajectories, advantages in batches for t, a in zip(trajectories, advantages)}
    rows = list(rows.values())
    assert len(rows) == 4 and sorted(t.metadata["segment"] for t, _ in rows) == [0, 0, 1, 1]
    _assert_rows_are_the_sampled_calls([t for t, _ in rows], served)
    agent_calls = [c for _, c in served if c.request_id.startswith("agent:")]
    assert sorted(len(_policy_runs(t)) for t, _ in rows) == [1, 1, 2, 2] and len(agent_calls) == 6
    trained = sorted(tuple(run) for t, _ in rows for run in _policy_runs(t))
    assert trained == sorted(tuple(c.token_ids) for c in agent_calls)  # every sampled call, once
    for trajectory, advantage in rows:  # a segment trains with its episode's advantage
        partner = [a for t, a in rows if t is not trajectory and t.reward is trajectory.reward]
        assert partner == [advantage]
