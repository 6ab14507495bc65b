"""Record formats: the common shapes of chat and preference data, converted to posttrain's own records.

SFT records (detected per source from the first record's fields, or set with `record_format`):

    messages           {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}
                       (OpenAI chat; content may be a list of parts: text parts are joined, see schema.py)
    sharegpt           {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}],
                        "system": "..." (optional)}; from: human, gpt, system, function_call, observation
    prompt_completion  {"prompt": "..." or [messages], "completion": "..." or [messages]}
    alpaca             {"instruction": "...", "input": "..." (optional), "output": "...", "system": optional}

A record matching two formats (say `messages` and `instruction`/`output` both present) is ambiguous: an error
naming the record that asks for `record_format`. Later records of the source must be of the detected format.

Preference records: explicit ``{prompt, chosen, rejected}``, or implicit ``{chosen, rejected}`` where both
are whole conversations sharing their first turns (UltraFeedback-binarized style): the shared turns are the
prompt, the rest the responses. Scores (``score_chosen``, ``score_rejected``, ``*_rating``) are kept as metadata.

`columns` renames the fields read (``{messages: dialog}``: the messages are in the column `dialog`);
`metadata` maps metadata keys to columns (``{domain: category, difficulty: level}``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from posttrain.data.schema import DataError, RecordError

RecordFormat = Literal["auto", "messages", "sharegpt", "prompt_completion", "alpaca"]

# The fields that identify each format (all of them must be present).
FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
}
SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
    "function_call": "assistant", "observation": "tool", "tool": "tool",
}
SCORE_FIELDS = ("score_chosen", "score_rejected", "chosen_score", "rejected_score", "chosen_rating",
                "rejected_rating")


class SourceFormat:
    """Converts one source's records; remembers the format detected on its first record."""

    def __init__(self, record_format: RecordFormat = "auto", columns: dict[str, str] | None = None,
                 metadata: dict[str, str] | None = None):
        self.record_format = record_format
        self.columns = dict(columns or {})
        self.metadata = dict(metadata or {})

    def to_sft(self, record: Any, origin: str) -> dict[str, Any]:
        """``{"messages": [...], "metadata": {...}}`` from a record of any SFT format."""
        record = self._mapped(record)
        if self.record_format == "auto":
            self.record_format = detect_format(record, origin)  # type: ignore[assignment]
        kind = self.record_format
        if kind == "messages":
            messages = _decoded(record.get("messages"), "messages")
        elif kind == "sharegpt":
            messages = sharegpt_messages(record)
        elif kind == "prompt_completion":
            messages = _turns(record, "prompt", "user") + _turns(record, "completion", "assistant")
        else:
            messages = alpaca_messages(record)
        return {"messages": messages, "metadata": record.get("metadata")}

    def to_pair(self, record: Any) -> dict[str, Any]:
        """``{"prompt", "chosen", "rejected", "metadata"}`` from an explicit or implicit preference record."""
        record = self._mapped(record)
        for key in ("chosen", "rejected"):
            if record.get(key) is None:
                raise RecordError(key, "missing")
        chosen, rejected = record["chosen"], record["rejected"]
        metadata = record.get("metadata")
        scores = {key: record[key] for key in SCORE_FIELDS if record.get(key) is not None}
        if scores:
            metadata = {**(metadata if isinstance(metadata, dict) else {}), **scores}
        if record.get("prompt") is not None:
            return {"prompt": record["prompt"], "chosen": chosen, "rejected": rejected,
                    "metadata": metadata}
        prompt, chosen, rejected = split_shared_prompt(chosen, rejected)
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "metadata": metadata}

    def _mapped(self, record: Any) -> dict[str, Any]:
        if not isinstance(record, dict):
            raise RecordError("<record>", f"expected an object, got {type(record).__name__}")
        if not self.columns and not self.metadata:
            return record
        record = dict(record)
        for field, column in self.columns.items():
            if column not in record:
                raise RecordError(column, f"missing (columns.{field} reads it)")
            record[field] = record.pop(column)
        if self.metadata:
            metadata = record.get("metadata")
            metadata = dict(metadata) if isinstance(metadata, dict) else {}
            for key, column in self.metadata.items():
                if column not in record:
                    raise RecordError(column, f"missing (metadata.{key} reads it)")
                if record[column] is not None:
                    metadata[key] = _number_if_numeric(record[column]) if key == "difficulty" else record[column]
            record["metadata"] = metadata
        return record


def detect_format(record: dict[str, Any], origin: str) -> str:
    """The one SFT format whose fields `record` has; ambiguity is a `DataError` naming the record."""
    matches = [name for name, fields in FORMAT_FIELDS.items() if all(record.get(f) is not None for f in fields)]
    if len(matches) > 1:
        raise DataError(f"{origin}: the record fits several formats ({', '.join(matches)}); set record_format "
                        "on this source to the one it is in")
    if not matches:
        expected = "; ".join("/".join(fields) for fields in FORMAT_FIELDS.values())
        raise RecordError("<record>", f"no known format: expected the fields {expected} "
                          f"(got {', '.join(sorted(record)) or 'none'}); map yours with columns")
    return matches[0]


def sharegpt_messages(record: dict[str, Any]) -> list[dict[str, Any]]:
    turns = _decoded(record.get("conversations"), "conversations")
    if not isinstance(turns, list) or not turns:
        raise RecordError("conversations", "expected a non-empty list of {from, value} objects")
    messages: list[dict[str, Any]] = []
    if isinstance(record.get("system"), str) and record["system"]:
        messages.append({"role": "system", "content": record["system"]})
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordError(f"conversations[{i}]", f"expected a {{from, value}} object, got {type(turn).__name__}")
        speaker, value = turn.get("from"), turn.get("value")
        if speaker not in SHAREGPT_ROLES:
            raise RecordError(f"conversations[{i}].from",
                              f"expected one of {', '.join(SHAREGPT_ROLES)}, got {speaker!r}")
        if not isinstance(value, str):
            raise RecordError(f"conversations[{i}].value", f"expected a string, got {type(value).__name__}")
        if speaker == "function_call":
            messages.append({"role": "assistant", "content": "",
                             "tool_calls": [{"type": "function", "function": _function_call(value, i)}]})
        else:
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": value})
    return messages


def alpaca_messages(record: dict[str, Any]) -> list[dict[str, Any]]:
    for key in ("instruction", "output"):
        if not isinstance(record.get(key), str):
            raise RecordError(key, f"expected a string, got {type(record.get(key)).__name__}")
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise RecordError("input", f"expected a string, got {type(extra).__name__}")
    prompt = record["instruction"] + (f"\n\n{extra}" if extra else "")
    messages = [{"role": "system", "content": record["system"]}] if isinstance(record.get("system"), str) \
        and record["system"] else []
    return messages + [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]


def split_shared_prompt(chosen: Any, rejected: Any) -> tuple[list[Any], list[Any], list[Any]]:
    """(prompt, chosen response, rejected response) of two whole conversations sharing their first turns.

    The prompt is the shared turns up to the last non-assistant one (a shared assistant turn stays in both
    responses: the prompt must end where a reply starts)."""
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(value, list) or len(value) < 2:
            raise RecordError(key, "no prompt given, so chosen must be a whole conversation (a list of messages "
                              "starting with the prompt's turns); or add a prompt field")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    while shared > 0 and isinstance(chosen[shared - 1], dict) and chosen[shared - 1].get("role") == "assistant":
        shared -= 1
    if shared == 0:
        raise RecordError("rejected", "shares no prompt turn with chosen (implicit-prompt pairs start with the "
                          "same user turns)")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _turns(record: dict[str, Any], key: str, role: str) -> list[Any]:
    value = record.get(key)
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list):
        return value
    raise RecordError(key, f"expected a string or a list of messages, got {type(value).__name__}")


def _decoded(value: Any, key: str) -> Any:
    """A list of messages held as JSON text (a CSV cell) is decoded; anything else is returned as it is.
    Only for fields that must be lists: a completion or a response string is text, whatever it starts with."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError as error:
            raise RecordError(key, f"looks like JSON but does not parse: {error.msg}") from None
    return value


def _function_call(value: str, index: int) -> dict[str, Any]:
    try:
        call = json.loads(value)
    except json.JSONDecodeError:
        call = None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise RecordError(f"conversations[{index}].value",
                          'a function_call turn holds a JSON object {"name": ..., "arguments": {...}}')
    return {"name": call["name"], "arguments": call.get("arguments", {})}


def _number_if_numeric(value: Any) -> Any:
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else number
    return value
