"""`posttrain chat`: talk to a checkpoint in the terminal, tokens streamed as they are sampled.

The conversation (the system prompt, then every turn) is rendered with the model's chat template at every turn,
so what the model sees is what training rendered. Commands:

    /reset               forget the conversation (the system prompt stays)
    /system TEXT         set the system prompt (empty: none)
    /set NAME VALUE      temperature, top_p, max_tokens, seed ("none" unsets the seed)
    /show                the settings and how many messages the history holds
    /help, /quit         (end of input quits too)

With ``--tools calculator,...`` the built-in tools (`posttrain.envs.tools`) are offered to the model; a call it
writes (``<tool_call>{...}</tool_call>``, parsed by the same parser the tool environments use) is shown, run, and
its result goes back to the model as a tool turn, until the model answers without a call (at most
``max_tool_rounds`` calls in a row).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from posttrain.chat import chat_ids
from posttrain.envs import lone_surrogate
from posttrain.rollout import ContinuousBatcher, RolloutError, StreamRequest
from posttrain.serve.errors import ServeError
from posttrain.serve.prompting import TextStream
from posttrain.types import PosttrainError, SamplingParams

_HELP = "commands: /reset, /system TEXT, /set temperature|top_p|max_tokens|seed VALUE, /show, /help, /quit"


@dataclass
class ChatSettings:
    system: str | None = None
    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    tools: list[str] = field(default_factory=list)
    max_tool_rounds: int = 4


class ChatSession:
    """The conversation with one engine; `reply` streams the assistant's answer (and tool calls) to `write`."""

    def __init__(self, engine: Any, settings: ChatSettings):
        from posttrain.envs import get_tool

        self.engine = engine
        self.settings = settings
        self.batcher = ContinuousBatcher(engine)
        self.messages: list[dict[str, Any]] = []
        try:
            self.tools = {name: get_tool(name) for name in settings.tools}
        except PosttrainError as error:
            raise ServeError(f"--tools: {error}") from None

    def reset(self) -> None:
        self.messages = []

    def reply(self, text: str, write: Any) -> None:
        """Answer a user turn; with tools, run the calls the model makes and let it continue."""
        if self.engine.num_threads is not None:  # the loop steps on this thread
            torch.set_num_threads(self.engine.num_threads)
        self.messages.append({"role": "user", "content": text})
        for _ in range(self.settings.max_tool_rounds + 1):
            content, calls = self._turn(write)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [{"type": "function", "function": call} for call in calls]
            self.messages.append(message)
            if not calls:
                return
            for call in calls:
                write(f"\n[tool call] {call['name']}({json.dumps(call['arguments'])})\n")
                result = self._run_tool(call)
                write(f"[tool result] {result}\n")
                self.messages.append({"role": "tool", "content": result})

    def _turn(self, write: Any) -> tuple[str, list[dict[str, Any]]]:
        tokenizer, settings = self.engine.tokenizer, self.settings
        system = [{"role": "system", "content": settings.system}] if settings.system else []
        schemas = [spec.schema() for spec in self.tools.values()] or None
        ids = chat_ids(tokenizer, system + self.messages, tools=schemas)
        sampling = SamplingParams(max_new_tokens=settings.max_tokens, temperature=settings.temperature,
                                  top_p=settings.top_p, seed=settings.seed, include_stop_in_output=False)
        request = StreamRequest(ids, sampling)
        try:
            self.batcher.submit(request)
        except RolloutError as error:
            self.messages.pop()
            raise ServeError(f"{error} (/reset starts over)") from None
        stream = TextStream(tokenizer, [], parse_tools=bool(self.tools))
        content, calls = "", []
        while not request.done:
            self.batcher.step()
            for event in request.drain():
                write(stream.add(event.token_id))
                if event.completion is not None:
                    last, found = stream.finish(event.completion.text)
                    write(last)
                    content = stream.sent
                    calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                             for c in found]
        if request.error is not None:
            raise ServeError(str(request.error))
        return content, calls

    def _run_tool(self, call: dict[str, Any]) -> str:
        from posttrain.envs import ToolContext, ToolError

        spec = self.tools.get(call["name"])
        if spec is None:
            return f"error: unknown tool '{call['name']}' (available: {', '.join(self.tools) or 'none'})"
        try:
            return asyncio.run(spec(ToolContext(), call["arguments"]))
        except ToolError as error:
            return f"error: {error}"


def run_chat(engine: Any, settings: ChatSettings, stdin: TextIO, stdout: TextIO) -> None:
    """The interactive loop over `stdin`/`stdout` (a test drives it with StringIO or a pipe)."""
    session = ChatSession(engine, settings)

    def write(text: str) -> None:
        if text:
            stdout.write(text)
            stdout.flush()

    write(f"posttrain chat: {_HELP}\n")
    while True:
        write("you> ")
        line = stdin.readline()
        if not line:
            write("\n")
            return
        line = line.strip()
        if not line:
            continue
        if lone_surrogate(line) is not None:  # bytes that are not UTF-8, decoded with surrogateescape
            write("[error] that line is not valid UTF-8 text; nothing was sent\n")
            continue
        if line.startswith("/"):
            if not _command(session, line, write):
                return
            continue
        write("assistant> ")
        try:
            session.reply(line, write)
        except ServeError as error:
            write(f"\n[error] {error}")
        write("\n")


def _command(session: ChatSession, line: str, write: Any) -> bool:
    """Run a /command; False to quit."""
    name, _, rest = line.partition(" ")
    settings = session.settings
    if name in ("/quit", "/exit"):
        return False
    if name == "/reset":
        session.reset()
        write("[history cleared]\n")
    elif name == "/system":
        settings.system = rest.strip() or None
        write(f"[system prompt: {settings.system!r}]\n")
    elif name == "/set":
        write(_set(settings, rest.split()) + "\n")
    elif name == "/show":
        write(f"[temperature={settings.temperature} top_p={settings.top_p} max_tokens={settings.max_tokens} "
              f"seed={settings.seed} tools={settings.tools} system={settings.system!r} "
              f"history={len(session.messages)} messages]\n")
    else:
        write(f"[{_HELP}]\n")
    return True


def _set(settings: ChatSettings, words: list[str]) -> str:
    kinds = {"temperature": float, "top_p": float, "max_tokens": int, "seed": int}
    if len(words) != 2 or words[0] not in kinds:
        return f"[usage: /set {'|'.join(kinds)} VALUE]"
    name, raw = words
    try:
        value = None if (name == "seed" and raw == "none") else kinds[name](raw)
    except ValueError:
        return f"[/set {name}: {raw!r} is not a {kinds[name].__name__}]"
    problem = _check(name, value)
    if problem:
        return f"[/set {name}: {problem}]"
    setattr(settings, name, value)
    return f"[{name} = {value}]"


def _check(name: str, value: Any) -> str | None:
    if name == "temperature" and not 0 <= value <= 2:
        return "must be in [0, 2]"
    if name == "top_p" and not 0 < value <= 1:
        return "must be in (0, 1]"
    if name == "max_tokens" and value < 1:
        return "must be >= 1"
    return None
