"""From OpenAI messages to prompt token ids, and from sampled tokens back to content, deltas and tool calls.

The chat template is the tokenizer's own (posttrain's models carry theirs); OpenAI's ``tools`` are handed to it
as they come (``apply_chat_template(tools=...)``), and an assistant message's ``tool_calls`` are given to the
template as dicts (their JSON-string ``arguments`` parsed), which is how the built-in template renders them.

Tool calls in the model's output are read with the model's own syntax (`posttrain.envs.parsing`, the
``<tool_call>{json}</tool_call>`` blocks posttrain's templates and tool environments use). ``tool_choice``
``"required"`` or a named function cannot be enforced on a free-running model; the server starts the assistant's
turn with the opening of a call instead (``<tool_call>{"name": "`` or ``<tool_call>{"name": "NAME",
"arguments":``), so the model writes the rest — the opening counts as part of the turn when it is parsed.

Streamed, a call goes out as OpenAI streams one (`ToolCallDeltas`): as soon as its name is written, a delta with
the call's ``id``, ``type`` and ``function.name`` (arguments ``""``); then the arguments object as the model
writes it, in fragments that concatenate to its JSON text. A call whose arguments are not written as a JSON
object after the name (a JSON string, or ``arguments`` before ``name``) sends them whole when the turn ends.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from posttrain.chat import ChatTemplateError, chat_ids
from posttrain.envs import TagJsonParser
from posttrain.serve.errors import APIError
from posttrain.serve.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
_PARSER = TagJsonParser(TOOL_OPEN, TOOL_CLOSE)
# The opening of a call body as the built-in template writes it: the name, then (when written) the arguments key.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"(\s*,\s*"arguments"\s*:\s*)?')


@dataclass
class ChatPrompt:
    token_ids: list[int]
    forced_prefix: str  # the opening of a tool call the server wrote for the model ("" when none)
    parse_tools: bool  # whether tool calls in the output become `tool_calls`


def hf_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as the dicts a Hugging Face chat template takes."""
    rendered = []
    for position, message in enumerate(messages):
        item: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                "content": message.text()}
        if message.tool_calls:
            calls = []
            for call in message.tool_calls:
                arguments = call.function.arguments
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments) if arguments.strip() else {}
                    except (json.JSONDecodeError, RecursionError) as error:  # nested past the parser: not JSON
                        raise APIError(400, f"messages[{position}].tool_calls: arguments are not JSON "
                                       f"({type(error).__name__}: {error})",
                                       param=f"messages[{position}].tool_calls") from None
                calls.append({"type": "function", "function": {"name": call.function.name, "arguments": arguments}})
            item["tool_calls"] = calls
        if message.tool_call_id:
            item["tool_call_id"] = message.tool_call_id
        if message.name:
            item["name"] = message.name
        rendered.append(item)
    return rendered


def render_chat(tokenizer: Any, request: ChatCompletionRequest) -> ChatPrompt:
    """The prompt token ids of a chat request (the generation prompt included)."""
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
    messages = hf_messages(request.messages)
    try:
        ids = chat_ids(tokenizer, messages, tools=tools)
    except ChatTemplateError as error:  # a template refusing these messages is the request's fault
        raise APIError(400, f"messages: the model's chat template cannot render them ({error})",
                       param="messages") from None
    choice = request.tool_choice
    prefix = ""
    if isinstance(choice, NamedToolChoice):
        # No space after the colon: a BPE tokenizer would make it a token of its own, where the model learned
        # it merged with what follows (' {"').
        prefix = TOOL_OPEN + json.dumps({"name": choice.function.name})[:-1] + ', "arguments":'
    elif choice == "required":
        prefix = TOOL_OPEN + '{"name": "'
    if prefix:
        ids += tokenizer.encode(prefix, add_special_tokens=False)
    return ChatPrompt(ids, prefix, bool(request.tools) and choice != "none")


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_of(text: str) -> tuple[str, list[dict[str, Any]]]:
    """The content outside well-formed call blocks, and the calls in OpenAI's shape."""
    turn = _PARSER.parse(text)
    calls = [
        {"id": _call_id(), "type": "function",
         "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
        for call in turn.well_formed
    ]
    return (turn.content if calls else text), calls


class _StreamedCall:
    def __init__(self, index: int, name: str):
        self.index, self.name, self.id = index, name, _call_id()
        self.arguments = ""  # the argument text sent so far
        self.raw = True  # the arguments are being sent as written (False: sent whole at the end)


class ToolCallDeltas:
    """One sequence's tool calls as OpenAI's stream deltas, from its text so far (see the module docstring).

    `update(text)` returns the deltas the text adds: ``{"index", "id", "type", "function": {"name",
    "arguments": ""}}`` once a call's name is complete, then ``{"index", "function": {"arguments": FRAGMENT}}``.
    `finish(text)` sends what the finished turn adds: arguments not streamed, and well-formed calls whose name was
    never streamed. Indexes count the calls sent. A block that turns out malformed after its name went out
    cannot be taken back; its text is also in the content, as in a non-streamed reply.
    """

    def __init__(self) -> None:
        self.calls: list[_StreamedCall | None] = []  # per call block in the text, once its name is sent
        self.sent = 0

    def update(self, text: str) -> list[dict[str, Any]]:
        deltas = []
        for number, body in enumerate(_call_bodies(text)):
            if number == len(self.calls):
                self.calls.append(None)
            head = _CALL_HEAD.match(body)
            if head is None:
                continue
            call = self.calls[number]
            if call is None:
                try:
                    name = json.loads(f'"{head.group(1)}"')
                except json.JSONDecodeError:
                    continue
                call = self.calls[number] = _StreamedCall(self.sent, name)
                self.sent += 1
                deltas.append({"index": call.index, "id": call.id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
            if head.group(2) is not None and call.raw:
                fragment = self._fragment(call, body[head.end():])
                if fragment:
                    deltas.append({"index": call.index, "function": {"arguments": fragment}})
        return deltas

    @staticmethod
    def _fragment(call: _StreamedCall, value: str) -> str:
        """The arguments object's text not yet sent (up to its closing brace)."""
        if not value:
            return ""
        if not value.startswith("{"):
            call.raw = False
            return ""
        written = value[:_json_object_end(value)]
        if written.endswith("\ufffd"):  # half a UTF-8 character
            written = written[:-1]
        if not written.startswith(call.arguments):  # the decoded text changed under us: send it whole at the end
            call.raw = False
            return ""
        fragment, call.arguments = written[len(call.arguments):], written
        return fragment

    def finish(self, text: str) -> list[dict[str, Any]]:
        deltas = self.update(text)
        for number, parsed in enumerate(_PARSER.parse(text).calls):
            if parsed.error is not None:
                continue
            call = self.calls[number] if number < len(self.calls) else None
            arguments = json.dumps(parsed.arguments)
            if call is None:
                deltas.append({"index": self.sent, "id": _call_id(), "type": "function",
                               "function": {"name": parsed.name, "arguments": arguments}})
                self.sent += 1
            elif not call.arguments:
                deltas.append({"index": call.index, "function": {"arguments": arguments}})
        return deltas


def _call_bodies(text: str) -> list[str]:
    """The text inside each call block, in order (the last one may still be open)."""
    bodies, position = [], 0
    while (start := text.find(TOOL_OPEN, position)) >= 0:
        start += len(TOOL_OPEN)
        end = text.find(TOOL_CLOSE, start)
        bodies.append(text[start:] if end < 0 else text[start:end])
        if end < 0:
            break
        position = end + len(TOOL_CLOSE)
    return bodies


def _json_object_end(value: str) -> int:
    """The index after the JSON object `value` begins with, or len(value) while it is still open."""
    depth, in_string, escaped = 0, False, False
    for position, char in enumerate(value):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return position + 1
    return len(value)


def merge_call_deltas(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive deltas of the same call as one (a stream chunk that carries several steps' tokens)."""
    merged: list[dict[str, Any]] = []
    for delta in deltas:
        if merged and merged[-1]["index"] == delta["index"]:
            merged[-1]["function"]["arguments"] += delta["function"]["arguments"]
        else:
            merged.append({**delta, "function": dict(delta["function"])})
    return merged


_DECODE_WINDOW = 8  # tokens `TextStream` decodes again at each token: between 8 and 16


class TextStream:
    """Turns one sequence's tokens into safe-to-send text deltas while it is being sampled.

    Held back: an incomplete UTF-8 character (decoded as U+FFFD), the last ``len(stop) - 1`` characters (they
    may begin a stop string), and, when tool calls are parsed, everything from the opening of a call on. The
    finished sequence's text is the engine's cut text (stop strings removed), from which `finish` sends the rest.
    """

    def __init__(self, tokenizer: Any, stops: list[str], parse_tools: bool, forced_prefix: str = ""):
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.parse_tools = parse_tools
        self.forced_prefix = forced_prefix
        self.tokens: list[int] = []
        self.text = ""  # the decoded tokens so far
        self.sent = ""
        # Incremental decoding (`_decoded`): the text before the window, the window's first token, and the
        # window's decode when it was placed. Not for tokenizers that clean up spaces across tokens (" ," -> ",").
        self._base, self._start, self._head = "", 0, ""
        self._incremental = not getattr(tokenizer, "clean_up_tokenization_spaces", False)

    def add(self, token_id: int) -> str:
        self.tokens.append(token_id)
        self.text = text = self._decoded()
        if self.forced_prefix:
            return ""  # the whole turn is a tool call
        safe = len(text) - self.hold
        if text.endswith("\ufffd"):
            safe = min(safe, len(text) - 1)
        if self.parse_tools:
            opened = text.find(TOOL_OPEN)
            if opened >= 0:
                safe = min(safe, opened)
            else:
                safe = min(safe, _partial_suffix(text, TOOL_OPEN))
        return self._send(text[:max(safe, len(self.sent))])

    def _decoded(self) -> str:
        """The text of all the tokens so far, as one decode of them all gives it, decoding only a window of the
        last few (decoding everything at every token is quadratic in the output's length): `_base` (the text
        before the window) plus the window's decode. The window moves on only where the text ends in a whole
        character and the new window's decode is the text's very end (so `_base` is what precedes it; what a
        decoder does at a sequence's start, a stripped leading space, is then already in that decode); a
        window that no longer begins with its text when placed (`_head`; never seen, but cheap to check) falls
        back to decoding everything."""
        if not self._incremental:
            return self._decode(self.tokens)
        window = self._decode(self.tokens[self._start:])
        if not window.startswith(self._head):
            self._base, self._start, self._head = "", 0, ""
            window = self._decode(self.tokens)
        text = self._base + window
        if len(self.tokens) - self._start >= 2 * _DECODE_WINDOW and not text.endswith("\ufffd"):
            start = len(self.tokens) - _DECODE_WINDOW
            head = self._decode(self.tokens[start:])
            if head and not head.startswith("\ufffd") and text.endswith(head):
                self._base, self._start, self._head = text[: len(text) - len(head)], start, head
        return text

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def finish(self, final_text: str) -> tuple[str, list[dict[str, Any]]]:
        """The last content delta and the tool calls, given the finished sequence's text."""
        content, calls = final_text, []
        if self.parse_tools:
            content, calls = tool_calls_of(self.forced_prefix + final_text)
        return self._send(content), calls

    def _send(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def _partial_suffix(text: str, tag: str) -> int:
    """Where a proper prefix of `tag` ending the text starts (len(text) when none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return len(text) - size
    return len(text)
