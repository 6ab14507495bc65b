"""The Environment contract and its registry.

An environment is the world one episode acts in. It is async because a step may wait on a sandbox:

    env = make_environment(task, sandbox=sandbox)
    observation = await env.reset(task)          # the task's messages (and the tools' schemas)
    result = await env.step(Action(text=...))    # the policy's turn -> new messages, done?, info
    state = env.final_state()                    # what the verifier judges (answer, files ...)

Observations are *messages* (tool results as ``{"role": "tool", ...}``), never tokens: turning them into tokens
is the episode loop's job (`posttrain.envs.episode`), which does it from the chat template's delta so the policy's
own tokens are never re-tokenized.

Environments register with ``@environment("name")`` on a class whose constructor takes keyword arguments (the
task's ``env_args`` plus ``sandbox`` and ``parser``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from posttrain.types import Message, PosttrainError, Task


class EnvError(PosttrainError):
    """An unknown environment or tool, or a task whose env spec cannot be run."""


class ToolError(Exception):
    """The call failed for a reason the model caused; the message becomes the error observation."""


class ToolInfraError(Exception):
    """A tool could not run for reasons that are not the model's (the sandbox failed to start ...).

    The episode ends as an infrastructure failure; it is never scored as the model's 0.
    """

    def __init__(self, message: str, failure: str = "sandbox_failure"):
        super().__init__(message)
        self.failure = failure


@dataclass
class Observation:
    """Messages the environment adds to the conversation, and the tool schemas the prompt shows."""

    messages: list[Message] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Action:
    """One policy turn: the engine's text and why it stopped (``"length"`` means cut off mid-turn)."""

    text: str
    finish_reason: str = "stop"

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class StepResult:
    """What a step returns.

    ``info`` keys the episode loop reads: ``assistant_message`` (the turn as a transcript message),
    ``tool_calls`` / ``tool_calls_ok`` (calls attempted / succeeded this step), ``failed`` (the step had a failed
    call), ``final_answer`` (the text judged when the episode ends here).
    """

    observation: Observation
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    async def reset(self, task: Task) -> Observation: ...

    async def step(self, action: Action) -> StepResult: ...

    def final_state(self) -> dict[str, Any]: ...


ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}


def environment(name: str):
    """Register an environment class (or factory taking keyword arguments) under `name`."""

    def register(factory: Callable[..., Environment]) -> Callable[..., Environment]:
        ENVIRONMENTS[name] = factory
        return factory

    return register


def make_environment(task: Task, **kwargs: Any) -> Environment:
    """The environment `task.env` names, built with `task.env_args` plus `kwargs` (sandbox, parser ...)."""
    if task.env not in ENVIRONMENTS:
        raise EnvError(
            f"task '{task.id}': unknown environment '{task.env}'; known: {', '.join(sorted(ENVIRONMENTS))}"
        )
    try:
        return ENVIRONMENTS[task.env](**{**task.env_args, **kwargs})
    except TypeError as error:
        raise EnvError(f"task '{task.id}': environment '{task.env}' rejects its env_args ({error})") from None
