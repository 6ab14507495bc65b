"""Judging an episode's final state with `posttrain.verify`, the same verifier evaluation uses.

The verifier sees the final answer (the last assistant turn's text) and the env's final state (the answer, the
workspace's files, the transcript). Verifiers are synchronous and may wait on a sandbox, so they run in a worker
thread and the event loop keeps serving other episodes; one registered ``blocking=False`` (pure Python, never
waits: exact, format, structured, refusal) runs on the loop's thread, sparing the hand-off.
"""

from __future__ import annotations

import asyncio
from typing import Any

from posttrain.types import Reward, Task


async def judge(task: Task, final_state: dict[str, Any]) -> Reward:
    from posttrain.verify import is_blocking, verify

    answer = final_state.get("answer") or ""
    if not is_blocking(task.verifier):
        return verify(task, answer, final_state)
    return await asyncio.to_thread(verify, task, answer, final_state)
