"""The tool-calling multi-turn environment.

Each policy turn is parsed for tool calls in the chat template's syntax (`posttrain.envs.parsing`):

* no call at all: the episode ends and the turn's content is the final answer;
* calls: each is run in order and answered by one ``{"role": "tool", "name": ..., "content": ...}`` message; a
  malformed call, a tool the task does not offer, bad arguments or a `ToolError` give an ``error: ...`` message
  and count as a failed call, and the episode goes on;
* a turn cut off by the token limit is not executed: it is the (truncated) final answer.

The task's ``tools`` name the tools on offer; ``env_args["files"]`` seeds the episode's workspace. The final state
is the last answer and the workspace's files, which is what verifiers of agentic tasks judge.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from posttrain.envs.base import Action, Observation, StepResult, environment
from posttrain.envs.parsing import ParsedTurn, ToolCall, get_parser
from posttrain.envs.tools import ToolContext, ToolError, get_tool, tool_schemas
from posttrain.envs.workspace import Workspace
from posttrain.types import Message, Task


async def tool_turn(turn: ParsedTurn, run: Callable[[ToolCall], Awaitable[tuple[str, bool]]]) -> StepResult:
    """The step of a turn with tool calls: `run` each call in order (its observation text, whether it succeeded),
    one tool message each; the step check (the share of calls that succeeded) is the step's ``step_reward``."""
    message: Message = {"role": "assistant", "content": turn.content}
    if turn.well_formed:
        message["tool_calls"] = [call.to_message() for call in turn.well_formed]
    observations, ok = [], 0
    for call in turn.calls:
        content, succeeded = await run(call)
        ok += succeeded
        observations.append({"role": "tool", "name": call.name or "error", "content": content})
    info = {
        "assistant_message": message,
        "tool_calls": len(turn.calls),
        "tool_calls_ok": ok,
        "failed": ok < len(turn.calls),
        "step_reward": ok / len(turn.calls),  # the step check: a process reward (`posttrain.envs.episode`)
    }
    return StepResult(Observation(messages=observations), done=False, info=info)


@environment("tools")
class ToolEnv:
    def __init__(self, sandbox: Any = None, parser: Any = None, files: dict[str, str] | None = None,
                 **options: Any):
        self.sandbox = sandbox
        self.parser = get_parser(parser)
        self.initial_files = dict(files or {})
        self.options = options
        self.task: Task | None = None
        self.context = ToolContext()
        self.answer: str | None = None

    async def reset(self, task: Task) -> Observation:
        self.task, self.answer = task, None
        self.context = ToolContext(task=task, workspace=Workspace(self.initial_files), sandbox=self.sandbox,
                                   options=dict(task.env_args))
        shown = tool_schemas(task.tools) if task.env_args.get("tool_schemas_in_prompt", True) else []
        return Observation(messages=[dict(m) for m in task.messages], tools=shown)

    async def step(self, action: Action) -> StepResult:
        if action.truncated:
            return self._final(action.text)
        turn = self.parser.parse(action.text)
        if not turn.calls:
            return self._final(action.text)
        return await tool_turn(turn, self._run)

    async def _run(self, call: ToolCall) -> tuple[str, bool]:
        assert self.task is not None
        if call.error is not None:
            return f"error: {call.error}", False
        if call.name not in self.task.tools:
            offered = ", ".join(self.task.tools) or "none"
            return f"error: unknown tool '{call.name}' (tools: {offered})", False
        try:
            return await get_tool(call.name)(self.context, call.arguments), True
        except ToolError as error:
            return f"error: {error}", False

    def _final(self, text: str) -> StepResult:
        self.answer = text
        message = {"role": "assistant", "content": text}
        return StepResult(Observation(), done=True, info={"assistant_message": message, "final_answer": text})

    def final_state(self) -> dict[str, Any]:
        return {"answer": self.answer, "files": self.context.workspace.snapshot()}
