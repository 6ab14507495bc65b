"""Tools an agent can call, registered by name with a JSON-schema description.

    @tool("calculator", "Evaluate an arithmetic expression exactly.",
          {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})
    async def calculator(ctx: ToolContext, expression: str) -> str: ...

A tool is an async (or plain) function of a `ToolContext` and the call's arguments, returning the text the model
sees. Arguments are validated against the schema before the call. A tool signals the *model's* mistake (bad path,
division by zero, tests that time out) by raising `ToolError`: the env returns it as an error observation and
counts a failed call. A failure of the *system* (the sandbox could not start) raises `ToolInfraError`, which ends
the episode as an infrastructure failure. Tools that execute code or touch files do so in the sandbox or in the
episode's in-memory `Workspace`, never on the host.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import jsonschema

from posttrain.envs.base import EnvError, ToolError
from posttrain.envs.calculator import CalculatorError, evaluate
from posttrain.envs.testing import run_project_tests
from posttrain.envs.workspace import Workspace, WorkspaceError
from posttrain.types import Task

MAX_OBSERVATION_CHARS = 4000


@dataclass
class ToolContext:
    """What a tool may touch: the episode's workspace, the sandbox (possibly None) and the task."""

    task: Task | None = None
    workspace: Workspace = field(default_factory=Workspace)
    sandbox: Any = None
    options: dict[str, Any] = field(default_factory=dict)  # the task's env_args


ToolFunction = Callable[..., "str | Awaitable[str]"]


@dataclass
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]
    function: ToolFunction

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Hugging Face tool schema (what ``apply_chat_template(tools=...)`` takes)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    async def __call__(self, ctx: ToolContext, arguments: dict[str, Any]) -> str:
        try:
            jsonschema.validate(arguments, self.parameters)
        except jsonschema.ValidationError as error:
            where = "/".join(str(p) for p in error.absolute_path) or "arguments"
            raise ToolError(f"bad arguments for '{self.name}' ({where}): {error.message}") from None
        result = self.function(ctx, **arguments)
        if inspect.isawaitable(result):
            result = await result
        return _cap(str(result))


TOOLS: dict[str, ToolSpec] = {}


def tool(name: str, description: str, parameters: dict[str, Any] | None = None):
    """Register `function(ctx, **arguments) -> str` as the tool `name`."""
    schema = parameters or {"type": "object", "properties": {}, "additionalProperties": False}

    def register(function: ToolFunction) -> ToolFunction:
        TOOLS[name] = ToolSpec(name=name, description=description, parameters=schema, function=function)
        return function

    return register


def get_tool(name: str) -> ToolSpec:
    if name not in TOOLS:
        raise EnvError(f"unknown tool '{name}'; known: {', '.join(sorted(TOOLS))}")
    return TOOLS[name]


def tool_schemas(names: list[str]) -> list[dict[str, Any]]:
    return [get_tool(name).schema() for name in names]


def _cap(text: str) -> str:
    if len(text) <= MAX_OBSERVATION_CHARS:
        return text
    return text[:MAX_OBSERVATION_CHARS] + f"\n... [{len(text) - MAX_OBSERVATION_CHARS} more characters cut]"


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


# --------------------------------------------------------------------------------------------------
# Built-in tools
# --------------------------------------------------------------------------------------------------


@tool(
    "calculator",
    "Evaluate an arithmetic expression exactly: + - * / // % ** and parentheses on decimal numbers.",
    _object({"expression": {"type": "string", "description": "e.g. 4821*397"}}, ["expression"]),
)
def calculator(ctx: ToolContext, expression: str) -> str:
    try:
        return evaluate(expression)
    except CalculatorError as error:
        raise ToolError(f"calculator: {error}") from None


@tool("list_files", "List the files in the project, one path per line.")
def list_files(ctx: ToolContext) -> str:
    return "\n".join(ctx.workspace.list()) or "(no files)"


@tool(
    "read_file",
    "Read a file of the project.",
    _object({"path": {"type": "string", "description": "relative path, e.g. src/app.py"}}, ["path"]),
)
def read_file(ctx: ToolContext, path: str) -> str:
    try:
        return ctx.workspace.read(path)
    except WorkspaceError as error:
        raise ToolError(str(error)) from None


@tool(
    "write_file",
    "Create or overwrite a file of the project with the given content.",
    _object({"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
)
def write_file(ctx: ToolContext, path: str, content: str) -> str:
    try:
        size = ctx.workspace.write(path, content)
    except WorkspaceError as error:
        raise ToolError(str(error)) from None
    return f"wrote {size} bytes to {path}"


@tool("run_tests", "Run the project's tests and show which pass and which fail.")
async def run_tests(ctx: ToolContext) -> str:
    report = await run_project_tests(ctx.workspace.snapshot(), ctx.sandbox, ctx.options)
    return report.text
