"""Bad-case attribution: every failed episode has a class, and a few transcripts per class are kept to read.

The class is the episode's `FailureClass` (`posttrain.types`), set by the episode loop and the task's verifier:
``format``, ``wrong_answer``, ``tool_error``, ``timeout``, ``sandbox_failure``, ``truncated``, ``infra``. The
transcripts are plain JSON (messages cut to `MAX_MESSAGE_CHARS`, the verifier's details as short strings):
model output is data here, and the report escapes it before it reaches HTML.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Iterable

from posttrain.evaluate.metrics import FAILURE_CLASSES, failure_class
from posttrain.types import Trajectory

MAX_MESSAGE_CHARS = 1500
MAX_DETAIL_CHARS = 300

FAILURE_LABELS = {
    "format": "format",
    "wrong_answer": "wrong answer",
    "tool_error": "tool error",
    "timeout": "timeout",
    "sandbox_failure": "sandbox failure",
    "truncated": "truncated",
    "infra": "infrastructure",
}


def failure_examples(trajectories: Iterable[Trajectory], per_class: int) -> dict[str, list[dict[str, Any]]]:
    """Up to `per_class` transcripts of failed episodes per class, spread over difficulty levels."""
    by_class: dict[str, list[Trajectory]] = defaultdict(list)
    for trajectory in trajectories:
        if not trajectory.reward.passed:
            by_class[failure_class(trajectory)].append(trajectory)
    examples = {}
    for name in FAILURE_CLASSES:
        if by_class.get(name) and per_class > 0:
            examples[name] = [transcript(t) for t in _spread(by_class[name], per_class)]
    return examples


def _spread(trajectories: list[Trajectory], count: int) -> list[Trajectory]:
    """`count` trajectories taking turns across difficulty levels (the first failures of each level first)."""
    levels: dict[int, list[Trajectory]] = defaultdict(list)
    for trajectory in trajectories:
        levels[trajectory.difficulty].append(trajectory)
    chosen: list[Trajectory] = []
    queues = [levels[level] for level in sorted(levels)]
    while len(chosen) < count and any(queues):
        for queue in queues:
            if queue and len(chosen) < count:
                chosen.append(queue.pop(0))
    return chosen


def transcript(trajectory: Trajectory) -> dict[str, Any]:
    """A failed episode as the report shows it: messages, verdict, evidence."""
    return {
        "task_id": trajectory.task_id,
        "difficulty": trajectory.difficulty,
        "failure": failure_class(trajectory),
        "score": trajectory.reward.score,
        "steps": trajectory.steps,
        "truncated": trajectory.truncated,
        "messages": [_message(m) for m in trajectory.messages],
        "details": {str(k): _short(v) for k, v in trajectory.reward.details.items() if k != "traceback"},
    }


def _message(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    out: dict[str, Any] = {"role": str(message.get("role", "")), "content": _cut(content if isinstance(content, str)
                                                                               else json.dumps(content, default=str))}
    if message.get("name"):
        out["name"] = str(message["name"])
    if message.get("tool_calls"):
        out["tool_calls"] = _cut(json.dumps(message["tool_calls"], default=str))
    return out


def _short(value: Any) -> str | int | float | bool | None:
    if value is None or isinstance(value, (bool, int, float)):
        return value
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= MAX_DETAIL_CHARS else text[:MAX_DETAIL_CHARS] + " …"


def _cut(text: str | None) -> str:
    text = text or ""
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return text[:MAX_MESSAGE_CHARS] + f" … [{len(text) - MAX_MESSAGE_CHARS} more characters]"
