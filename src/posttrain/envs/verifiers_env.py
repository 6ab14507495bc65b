"""prime-rl `verifiers` (v1) tasks as posttrain environments (``env: verifiers``), run by posttrain's episode loop.

    task.env = "verifiers"; task.env_args = {"taskset": "my_taskset", "index": 3, "config": {...}}

The policy is posttrain's: its turns are sampled by posttrain's engine from the exact token sequence and never
re-tokenized (`posttrain.envs.tokens`); verifiers contributes the task (its prompt), its tools and its rubric. The
task's messages come from the `verifiers` task's data (``system_prompt``, ``prompt``). When the task declares
toolsets (`verifiers.v1.Task.toolsets`), their ``@vf.tool`` methods are the episode's tools, called in process
with the arguments the policy wrote (parsed in the chat template's tool-call syntax, `posttrain.envs.parsing`),
their JSON schemas shown through the chat template's ``tools``; a turn without a call ends the episode. A tool
that raises answers ``error: ...`` (the model's failed call); one that does not return within ``tool_timeout_s``
is an infrastructure failure. Each tool step's share of calls that succeeded is its ``step_reward`` (the process
signal). The transcript is judged by the task's own rewards (the ``verifiers`` verifier,
`posttrain.verify.verifiers_rubric`).

Untested here: verifiers' own harnesses, runtimes and MCP tool servers run out of process (containers, sandboxes,
an intercepted OpenAI endpoint); this adapter does not start them, and a tool that needs its server's state or a
runtime is out of its reach.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable

from posttrain.envs.base import Action, EnvError, Observation, StepResult, ToolInfraError, environment
from posttrain.envs.parsing import get_parser
from posttrain.envs.tool_env import tool_turn
from posttrain.types import Task

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def vf_task_messages(vf_task: Any) -> list[dict[str, Any]]:
    """The chat messages a `verifiers` task opens with (its system prompt, then its prompt)."""
    data = vf_task.data
    messages: list[dict[str, Any]] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        for message in data.prompt or []:
            dumped = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
            messages.append({"role": dumped["role"], "content": dumped.get("content") or ""})
    return messages


def vf_tools(vf_task: Any) -> dict[str, Callable[..., Any]]:
    """Tool name -> bound ``@vf.tool`` method of every toolset the task declares."""
    from verifiers.v1.utils.decorators import discover_decorated

    tools: dict[str, Callable[..., Any]] = {}
    for toolset in type(vf_task).toolsets(vf_task.config):
        for fn in discover_decorated(toolset, "tool"):
            tools[getattr(fn, "tool_name", None) or fn.__name__] = fn
    return tools


def tool_schema(name: str, fn: Callable[..., Any]) -> dict[str, Any]:
    """A function's JSON schema from its signature (the way MCP advertises a tool)."""
    properties, required = {}, []
    for parameter in inspect.signature(fn).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        kind = _JSON_TYPES.get(parameter.annotation if isinstance(parameter.annotation, type) else str, "string")
        properties[parameter.name] = {"type": kind}
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    return {"type": "function", "function": {"name": name, "description": (fn.__doc__ or "").strip(),
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


@environment("verifiers")
class VerifiersEnv:
    def __init__(self, taskset: str, index: int, config: dict[str, Any] | None = None, max_tasks: int = 100_000,
                 tool_timeout_s: float = 30.0, sandbox: Any = None, parser: Any = None):
        self.taskset, self.index, self.config, self.max_tasks = taskset, int(index), config, max_tasks
        self.tool_timeout_s = tool_timeout_s
        self.parser = get_parser(parser)
        self.tools: dict[str, Callable[..., Any]] = {}
        self.answer: str | None = None

    async def reset(self, task: Task) -> Observation:
        from posttrain.verify import verifiers_tasks

        tasks = await asyncio.to_thread(verifiers_tasks, self.taskset, self.config, self.max_tasks)
        if not 0 <= self.index < len(tasks):
            raise EnvError(f"verifiers taskset {self.taskset!r} has {len(tasks)} tasks; no task {self.index}")
        self.tools = vf_tools(tasks[self.index])
        schemas = [tool_schema(name, fn) for name, fn in self.tools.items()]
        return Observation(messages=[dict(m) for m in task.messages], tools=schemas)

    async def step(self, action: Action) -> StepResult:
        turn = self.parser.parse(action.text) if self.tools and not action.truncated else None
        if turn is None or not turn.calls:
            self.answer = action.text
            return StepResult(Observation(), done=True, info={
                "assistant_message": {"role": "assistant", "content": action.text}, "final_answer": action.text})
        return await tool_turn(turn, self._call)

    async def _call(self, call: Any) -> tuple[str, bool]:
        if call.error is not None:
            return f"error: {call.error}", False
        fn = self.tools.get(call.name)
        if fn is None:
            return f"error: unknown tool '{call.name}' (tools: {', '.join(self.tools) or 'none'})", False
        try:
            pending = fn(**call.arguments) if inspect.iscoroutinefunction(fn) else asyncio.to_thread(
                fn, **call.arguments)
            result = await asyncio.wait_for(pending, self.tool_timeout_s)
        except asyncio.TimeoutError:
            raise ToolInfraError(f"verifiers tool {call.name!r} did not return within {self.tool_timeout_s:g} s",
                                 failure="infra") from None
        except Exception as error:  # noqa: BLE001 - bad arguments or the tool refusing them: the model's call failed
            return f"error: {type(error).__name__}: {error}", False
        return str(result), True

    def final_state(self) -> dict[str, Any]:
        return {"answer": self.answer}
