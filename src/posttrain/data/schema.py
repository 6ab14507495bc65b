"""The SFT sample: chat messages plus metadata, and its validation.

A record on disk (one JSONL line, one Parquet row, one dataset row) looks like

    {"messages": [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "46"}],
     "metadata": {"domain": "arithmetic", "difficulty": 2, "reasoning_trace": "2+4=6 ...",
                  "source": "generated", "any_extra": "kept"}}

Metadata keys other than the four named ones are kept in `extras` and can be mixed on like the others.
A message's content is a string or a list of OpenAI-style parts: text parts (``{"type": "text", "text": ...}``)
are joined with a newline; any other part (an image, audio) is an error naming it. Chats with images are
read by `posttrain.data.images` (`read_vision_samples`).
`validate_record` turns a raw record into an `SFTSample` or raises `RecordError` naming the field.
`metadata.origin` is where the sample was read (``train.jsonl:17``), set by the readers so that every later
error about the sample (tokenization, packing) names the file and line; it is not written back out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.types import Message, PosttrainError

ROLES = ("system", "user", "assistant", "tool")


class DataError(PosttrainError):
    """Training data is missing or malformed; the message names file, line and field."""


class RecordError(ValueError):
    """One record is invalid; `field` is the dotted path inside the record."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclass
class SampleMetadata:
    domain: str = "general"
    difficulty: int | None = None
    reasoning_trace: str | None = None
    source: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    origin: str | None = None  # "file:line" / "file:row N" it was read from; never written out

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value by name, named fields and extras alike (what mixing groups on)."""
        if key in ("domain", "difficulty", "reasoning_trace", "source"):
            value = getattr(self, key)
            return default if value is None else value
        return self.extras.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        data = {"domain": self.domain, "difficulty": self.difficulty, "reasoning_trace": self.reasoning_trace,
                "source": self.source}
        data = {k: v for k, v in data.items() if v is not None}
        data.update(self.extras)
        return data


@dataclass
class SFTSample:
    messages: list[Message]
    metadata: SampleMetadata = field(default_factory=SampleMetadata)

    @property
    def prompt_text(self) -> str:
        """Everything before the first assistant turn: the identity used for held-out splits."""
        parts = []
        for message in self.messages:
            if message["role"] == "assistant":
                break
            parts.append(f"{message['role']}:{message.get('content') or ''}")
        return "\n".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"messages": self.messages, "metadata": self.metadata.to_dict()}


def require_prompt_first(messages: list[Message]) -> None:
    """A reply is trained on as the answer to what came before it: a conversation that opens with one has no
    prompt to render before it (chat templates refuse an empty conversation), so it is the record's error."""
    if messages[0]["role"] == "assistant":
        raise RecordError("messages[0].role", "the conversation starts with an assistant turn, which has no prompt "
                          "before it to be trained as a reply to; put a system or user message first, or drop it")


def validate_record(record: Any, default_source: str | None = None) -> SFTSample:
    """Check one raw record and build the sample; raise `RecordError` with the offending field."""
    if not isinstance(record, dict):
        raise RecordError("<record>", f"expected an object, got {type(record).__name__}")
    messages = record.get("messages")
    if messages is None:
        raise RecordError("messages", "missing")
    if not isinstance(messages, list) or not messages:
        raise RecordError("messages", "expected a non-empty list of {role, content} objects")
    clean = [_validate_message(message, f"messages[{i}]") for i, message in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in clean):
        raise RecordError("messages", "no assistant turn (nothing to train on)")
    require_prompt_first(clean)
    meta = record.get("metadata", {}) or {}
    if not isinstance(meta, dict):
        raise RecordError("metadata", f"expected an object, got {type(meta).__name__}")
    return SFTSample(messages=clean, metadata=_validate_metadata(meta, default_source))


def message_role(message: Any, where: str) -> str:
    """The role of a message object, or a `RecordError` naming `where` (the message) or its role."""
    if not isinstance(message, dict):
        raise RecordError(where, f"expected an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise RecordError(f"{where}.role", f"expected one of {', '.join(ROLES)}, got {role!r}")
    return role


def _validate_message(message: Any, where: str) -> Message:
    role = message_role(message, where)
    content = message.get("content")
    tool_calls = message.get("tool_calls")
    if content is None and not tool_calls:
        raise RecordError(f"{where}.content", "missing")
    if isinstance(content, list):
        content = text_of_parts(content, f"{where}.content")
    if content is not None and not isinstance(content, str):
        raise RecordError(f"{where}.content", f"expected a string or a list of text parts, got "
                          f"{type(content).__name__}")
    if tool_calls is not None:
        if role != "assistant" or not isinstance(tool_calls, list):
            raise RecordError(f"{where}.tool_calls", "only an assistant message may carry a list of tool calls")
        for j, call in enumerate(tool_calls):
            function = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RecordError(f"{where}.tool_calls[{j}]", "expected {function: {name, arguments}}")
    clean: Message = {"role": role, "content": content or ""}
    if tool_calls:
        clean["tool_calls"] = tool_calls
    for key in ("name", "tool_call_id"):
        if key in message:
            clean[key] = message[key]
    return clean


def text_of_parts(parts: list[Any], where: str) -> str:
    """The text parts of a list-of-parts content joined with a newline; any other part a `RecordError` at `where`."""
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            got = repr(kind) if isinstance(part, dict) else type(part).__name__
            raise RecordError(f"{where}[{j}]", f"only text parts ({{type: text, text: ...}}) can be trained on, "
                              f"got {got} (chats with images train a vision-language model: set model.vision: true, "
                              "docs/multimodal.md)")
        texts.append(part["text"])
    return "\n".join(texts)


def _validate_metadata(meta: dict[str, Any], default_source: str | None) -> SampleMetadata:
    domain = meta.get("domain", "general")
    if not isinstance(domain, str):
        raise RecordError("metadata.domain", f"expected a string, got {type(domain).__name__}")
    difficulty = meta.get("difficulty")
    if difficulty is not None and (isinstance(difficulty, bool) or not isinstance(difficulty, (int, float))):
        raise RecordError("metadata.difficulty", f"expected a number, got {difficulty!r}")
    trace = meta.get("reasoning_trace")
    if trace is not None and not isinstance(trace, str):
        raise RecordError("metadata.reasoning_trace", f"expected a string, got {type(trace).__name__}")
    source = meta.get("source", default_source)
    extras = {k: v for k, v in meta.items() if k not in ("domain", "difficulty", "reasoning_trace", "source")}
    return SampleMetadata(
        domain=domain,
        difficulty=int(difficulty) if difficulty is not None else None,
        reasoning_trace=trace,
        source=source,
        extras=extras,
    )
