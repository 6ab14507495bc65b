"""The ``verifiers`` verifier: an episode judged by the rewards of a prime-rl `verifiers` (v1) task.

A `verifiers` taskset is loaded through the package's own loader (`verifiers.v1.utils.loaders`: an installed
taskset package by id, any importable module exporting one `Taskset` subclass in ``__all__``, or such a
``.py`` file) and its tasks are
cached per (taskset, config). To judge an episode, its transcript (``final_state["messages"]``, posttrain's chat
messages) becomes a `verifiers.v1.Trace` -- a linear message graph whose assistant turns are marked sampled, with
tool calls paired to their results -- and the task's own `Task.score` runs its ``@vf.reward`` functions (and
metrics, and plugged judges) offline, with no runtime. Each named reward becomes a component of the `Reward`
(its raw value; the weights are in ``details["weights"]``, the metrics in ``details["metrics"]``); the score is the
weighted sum (`Trace.reward`), and ``passed`` is ``score >= pass_threshold`` (default: the sum of the weights,
every reward at 1). A reward function that raises, or a scoring that exceeds ``timeout_s``, is an infrastructure
failure: masked and retried, never a 0. The rubric runs on an event loop of its own in a worker thread, and the
verifier waits for each scoring at most ``timeout_s``: `asyncio.wait_for` alone cannot stop a reward that blocks
(a sync function, or an ``async def`` that calls ``time.sleep`` or blocking I/O holds the loop, so its timer never
fires). A scoring past its limit is abandoned, not killed -- Python cannot kill a thread: its (daemon) thread runs
on until the function returns, its result is dropped, and it does not keep the process from exiting.

**Per-turn scores** (``turn_scores: true``, a process signal from a rubric that scores whole traces): the rubric
also scores each turn's prefix -- the transcript up to that assistant turn and the observations it caused (its
tool results), before the next assistant turn -- so turn k's score is what the rubric would give had the episode
stopped after it. The scores are ``details["step_rewards"]`` and their mean is ``components["process"]``, which
the RL return weighs by ``returns.process_weight``; the score stays the whole trace's. A rubric that rewards
partial progress (a tool call that returned the right value) then credits the turn that made it. Costs one
scoring per assistant turn, and each scoring -- the whole trace's and every turn prefix's -- has its own
``timeout_s``: a slow turn does not spend the others' time (the judging of an episode may take up to
(turns + 1) x ``timeout_s``), and a turn whose own scoring exceeds it makes the episode an infrastructure failure
(its error names the turn), like the whole trace's.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from itertools import islice
from pathlib import Path
from typing import Any

from posttrain.types import FailureClass, Reward
from posttrain.usercode import import_entry, is_file_ref
from posttrain.verify.errors import VerifyError
from posttrain.verify.registry import verifier

_CACHE: dict[str, list[Any]] = {}
_LOCK = threading.Lock()


def verifiers_tasks(taskset: str, config: dict[str, Any] | None = None, max_tasks: int = 100_000) -> list[Any]:
    """The tasks of `taskset` (a `verifiers` taskset id or module) built with `config`, in the taskset's order."""
    key = json.dumps([taskset, config or {}, max_tasks], sort_keys=True, default=str)
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = _load(taskset, dict(config or {}), max_tasks)
        return _CACHE[key]


def _load(taskset: str, config: dict[str, Any], max_tasks: int) -> list[Any]:
    try:
        from verifiers.v1.utils.loaders import load_taskset, taskset_config_type
    except ImportError:
        raise VerifyError("verifiers environments need the verifiers package: pip install verifiers") from None
    if is_file_ref(taskset):
        taskset = _file_taskset(taskset)
    try:
        settings = taskset_config_type(taskset).model_validate({**config, "id": taskset})
        tasks = list(islice(iter(load_taskset(settings)), max_tasks))
    except (ImportError, AttributeError, TypeError, ValueError) as error:
        raise VerifyError(f"verifiers taskset {taskset!r}: {type(error).__name__}: {error}") from None
    if not tasks:
        raise VerifyError(f"verifiers taskset {taskset!r} has no tasks (config {config})")
    return tasks


def _file_taskset(path: str) -> str:
    """Import a taskset file and make it importable by its stem, the only form verifiers' loader takes."""
    import sys

    module = import_entry(path)
    name = Path(path).stem.replace("-", "_").lower()
    if sys.modules.setdefault(name, module) is not module:
        raise VerifyError(f"verifiers taskset file {path}: a module named {name!r} is already imported; rename it")
    return name


def to_trace(vf_task: Any, messages: list[dict[str, Any]]) -> Any:
    """A `verifiers.v1.Trace` of `vf_task` holding `messages` as one branch (assistant turns sampled)."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask

    nodes, pending_ids = [], []
    for message in messages:
        role = message.get("role")
        content = message.get("content") or ""
        if role == "system":
            converted: Any = vf.SystemMessage(content=content)
        elif role == "user":
            converted = vf.UserMessage(content=content)
        elif role == "assistant":
            calls = []
            for call in message.get("tool_calls") or []:
                function = call.get("function", {})
                arguments = function.get("arguments", {})
                call_id = f"call_{len(nodes)}_{len(calls)}"
                calls.append(vf.ToolCall(id=call_id, name=str(function.get("name", "")),
                                         arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)))
            pending_ids = [c.id for c in calls]
            converted = vf.AssistantMessage(content=content, tool_calls=calls or None)
        elif role == "tool":
            call_id = pending_ids.pop(0) if pending_ids else f"call_{len(nodes)}"
            converted = vf.ToolMessage(tool_call_id=call_id, content=content, name=message.get("name"))
        else:
            continue
        nodes.append(MessageNode(message=converted, parent=len(nodes) - 1 if nodes else None,
                                 sampled=role == "assistant"))
    return vf.Trace(task=TraceTask(type=type(vf_task).__name__, data=vf_task.data, key=vf_task.key,
                                   hash=vf_task.hash),
                    agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes)


@verifier("verifiers")
def verify_verifiers(completion: str, *, taskset: str, index: int, config: dict[str, Any] | None = None,
                     max_tasks: int = 100_000, pass_threshold: float | None = None, timeout_s: float = 60.0,
                     turn_scores: bool = False, final_state: dict[str, Any] | None = None) -> Reward:
    """The episode's transcript judged by task `index` of `taskset`'s own rewards (and, with `turn_scores`, each
    turn's prefix: the process component); `timeout_s` bounds each of those scorings on its own."""
    vf_task = verifiers_tasks(taskset, config, max_tasks)[index]
    messages = list((final_state or {}).get("messages") or [])
    if not messages:
        messages = [{"role": "assistant", "content": completion}]
    trace = to_trace(vf_task, messages)
    prefixes = [to_trace(vf_task, prefix) for prefix in turn_prefixes(messages)] if turn_scores else []
    try:
        _score_each(vf_task, [trace, *prefixes], timeout_s)
    except Exception as error:  # noqa: BLE001 - the environment's rubric failed: the system's failure
        return Reward(score=0.0, passed=False, failure=FailureClass.INFRA,
                      details={"error": f"verifiers scoring: {type(error).__name__}: {error}"[:2000]})
    rewards = {name: r for name, r in trace.rewards.items() if r is not None}
    components = {name: float(r.score) for name, r in rewards.items()}
    weights = {name: float(r.weight) for name, r in rewards.items()}
    score = float(trace.reward)
    threshold = sum(weights.values()) if pass_threshold is None else pass_threshold
    passed = score >= threshold - 1e-9
    metrics = {name: value for name, value in trace.metrics.items() if value is not None}
    details = {"weights": weights, "metrics": metrics, "taskset": taskset, "index": index}
    if prefixes:
        details["step_rewards"] = [float(prefix.reward) for prefix in prefixes]
        components["process"] = sum(details["step_rewards"]) / len(prefixes)
    return Reward(score=score, passed=passed, failure=FailureClass.NONE if passed else FailureClass.WRONG_ANSWER,
                  components=components, details=details)


def turn_prefixes(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """One prefix per assistant turn: the messages up to the next assistant turn (the turn's observations in)."""
    turns = [i for i, message in enumerate(messages) if message.get("role") == "assistant"]
    return [messages[:end] for end in [*turns[1:], len(messages)]]


_TIMED_OUT = object()


def _score_each(vf_task: Any, traces: list[Any], timeout_s: float) -> None:
    """Score the whole trace, then each turn's prefix, each under its own `timeout_s`, in a worker thread.

    An async rubric is cancelled at its limit (`asyncio.wait_for` inside the worker); one that blocks its loop is
    caught by this thread's wait on the worker, and abandoned (see the module docstring)."""
    outcomes: queue.SimpleQueue = queue.SimpleQueue()  # one per scoring: None, _TIMED_OUT or the error raised

    async def score_in_order() -> None:
        for trace in traces:  # in order: a rubric may keep state between calls
            try:
                await asyncio.wait_for(vf_task.score(trace), timeout_s)
            except asyncio.TimeoutError:
                outcomes.put(_TIMED_OUT)
                return
            outcomes.put(None)

    def work() -> None:
        try:
            asyncio.run(score_in_order())
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread, which classifies it
            outcomes.put(error)

    threading.Thread(target=work, name="verifiers-rubric", daemon=True).start()
    for number in range(len(traces)):
        try:
            outcome = outcomes.get(timeout=timeout_s)
        except queue.Empty:
            outcome = _TIMED_OUT
        if outcome is _TIMED_OUT:
            what = f"turn {number}'s prefix" if number else "the whole trace"
            raise TimeoutError(f"scoring {what} took longer than {timeout_s:g} s")
        if outcome is not None:
            raise outcome
