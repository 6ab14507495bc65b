"""Tool-call parsers: turn the policy's text into content plus tool calls, in a chat template's syntax.

The built-in template (and Hermes/Qwen-style templates, which use the same syntax) writes a call inside the
assistant turn as ``<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>``.
`TagJsonParser` reads that; another template's syntax is another class with the same `parse` method, registered
in `PARSERS` (a task picks one with ``env_args["parser"]``).

A block that opens but does not close, whose JSON does not parse, or that lacks a string ``name`` or a dict of
``arguments`` is a *malformed* call: it is returned with ``error`` set, and the env answers it with an error
observation instead of ending the episode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ToolCall:
    """A call as the model wrote it; a malformed one has ``error`` set (and may have no usable name)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def to_message(self) -> dict[str, Any]:
        """The Hugging Face form an assistant message carries in ``tool_calls``."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    """One assistant turn: its text outside the well-formed call blocks, and every call attempted, in order.

    A malformed block stays in ``content`` (it is what the model wrote) and appears in ``calls`` with ``error``.
    """

    content: str
    calls: list[ToolCall] = field(default_factory=list)

    @property
    def well_formed(self) -> list[ToolCall]:
        return [call for call in self.calls if call.error is None]


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


class TagJsonParser:
    """``<open>{json}</close>`` blocks anywhere in the turn; whitespace around the JSON is allowed."""

    def __init__(self, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>"):
        self.open_tag = open_tag
        self.close_tag = close_tag

    def parse(self, text: str) -> ParsedTurn:
        content_parts: list[str] = []
        turn = ParsedTurn(content="")
        position = 0
        while True:
            start = text.find(self.open_tag, position)
            if start < 0:
                content_parts.append(text[position:])
                break
            content_parts.append(text[position:start])
            end = text.find(self.close_tag, start + len(self.open_tag))
            if end < 0:
                content_parts.append(text[start:])
                turn.calls.append(_malformed(f"'{self.open_tag}' without '{self.close_tag}'"))
                break
            call = _parse_call(text[start + len(self.open_tag) : end])
            turn.calls.append(call)
            position = end + len(self.close_tag)
            if call.error is not None:
                content_parts.append(text[start:position])
        turn.content = "".join(content_parts)
        return turn


def _malformed(reason: str, name: str = "") -> ToolCall:
    return ToolCall(name=name, error=f"malformed tool call: {reason}")


def _parse_call(body: str) -> ToolCall:
    try:
        data = json.loads(body.strip())
    except json.JSONDecodeError as error:
        return _malformed(f"invalid JSON ({error.msg} at char {error.pos})")
    except RecursionError:  # nested past the parser's depth: the model's text, never a crash of the episode
        return _malformed("invalid JSON (nested too deeply)")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return _malformed('expected {"name": "<tool>", "arguments": {...}}')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI-style: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return _malformed("arguments must be a JSON object", name=data["name"])
    return ToolCall(name=data["name"], arguments=arguments)


PARSERS: dict[str, ToolCallParser] = {
    "tool_call_tags": TagJsonParser(),  # the built-in template
    "hermes": TagJsonParser(),  # Hermes / Qwen2.5 / Qwen3 use the same tags and JSON
}


def get_parser(name_or_parser: str | ToolCallParser | None) -> ToolCallParser:
    from posttrain.envs.base import EnvError

    if name_or_parser is None:
        return PARSERS["tool_call_tags"]
    if not isinstance(name_or_parser, str):
        return name_or_parser
    if name_or_parser not in PARSERS:
        raise EnvError(f"unknown tool-call parser '{name_or_parser}'; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name_or_parser]


def lone_surrogate(value: Any) -> str | None:
    """Where in a parsed JSON body (dicts, lists, strings) a string or key holds a lone surrogate, as a dotted path
    (``messages.0.content``; ``body`` for the top); None when every text is valid Unicode."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        texts = [item] if isinstance(item, str) else list(item) if isinstance(item, dict) else []
        for text in texts:
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    return ".".join(str(part) for part in path) or "body"
        if isinstance(item, dict):
            stack.extend(((*path, key), inner) for key, inner in item.items())
        elif isinstance(item, list):
            stack.extend(((*path, index), inner) for index, inner in enumerate(item))
    return None
