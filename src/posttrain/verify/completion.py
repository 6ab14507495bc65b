"""What a verifier reads: the model's final text, from a string, bytes or a `Trajectory`, made safe to parse.

`final_text` returns the text or the reason it cannot be judged (``non_utf8``, ``binary``, ``too_long``); a
verifier turns a reason into a 0 with ``FailureClass.FORMAT``, never an exception. For a `Trajectory` the text
is the last assistant message's content. `strip_reasoning` drops a leading ``<think>...</think>`` block, and
`code_block` finds the program in a completion.
"""

from __future__ import annotations

import re
from typing import Any

from posttrain.types import FailureClass, Reward, Trajectory

MAX_COMPLETION_CHARS = 200_000
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_THINK = re.compile(r"^.*</think>", re.DOTALL)
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def _message_text(content: Any) -> str:
    if isinstance(content, list):  # multimodal-style content parts
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "" if content is None else content


def final_text(completion: Any, max_chars: int = MAX_COMPLETION_CHARS) -> tuple[str, str | None]:
    """(text, None) or ("", reason) when the completion cannot be judged."""
    if isinstance(completion, Trajectory):
        assistant = [m for m in completion.messages if m.get("role") == "assistant"]
        completion = _message_text(assistant[-1].get("content")) if assistant else ""
    if completion is None:
        return "", None
    if isinstance(completion, (bytes, bytearray, memoryview)):
        try:
            completion = bytes(completion).decode("utf-8")
        except UnicodeDecodeError:
            return "", "non_utf8"
    if not isinstance(completion, str):
        return "", "not_text"
    if len(completion) > max_chars:
        return "", "too_long"
    try:
        completion.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: decoded garbage
        return "", "non_utf8"
    controls = len(_CONTROL.findall(completion))
    if controls > 8 and controls > len(completion) // 20:
        return "", "binary"
    return completion, None


def unjudgeable(reason: str, **details: Any) -> Reward:
    """The 0 a completion gets when there is nothing to judge in it."""
    return Reward(score=0.0, passed=False, failure=FailureClass.FORMAT, details={"reason": reason, **details})


def strip_reasoning(text: str) -> str:
    """The text after the last ``</think>`` (the whole text when there is none)."""
    return _THINK.sub("", text, count=1) if "</think>" in text else text


def tagged(text: str, opening: str, closing: str) -> list[str]:
    """Every ``opening...closing`` span's content, found in linear time (a lazy regex over a text with many
    unclosed openings is quadratic, and the text is the model's)."""
    found, start = [], 0
    lowered = text.lower()
    while True:
        begin = lowered.find(opening, start)
        if begin < 0:
            return found
        end = lowered.find(closing, begin + len(opening))
        if end < 0:
            return found
        found.append(text[begin + len(opening):end])
        start = end + len(closing)


def code_block(text: str, languages: tuple[str, ...] = ("python", "py", "python3", "")) -> str | None:
    """The last fenced code block in one of `languages` ("" = no language given); None when there is none."""
    blocks = [body for lang, body in _FENCE.findall(strip_reasoning(text)) if lang.lower() in languages]
    return blocks[-1] if blocks else None
