"""Judging an episode's final state with `posttrain.verify`, the same verifier evaluation uses.

The verifier sees the final answer (the last assistant turn's text) and the env's final state (the answer, the
workspace's files, the transcript). Verifiers are synchronous and may wait on a sandbox, so they run in a worker
thread and the event loop keeps serving other episodes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from posttrain.types import Reward, Task


async def judge(task: Task, final_state: dict[str, Any]) -> Reward:
    from posttrain.verify import verify

    answer = final_state.get("answer") or ""
    return await asyncio.to_thread(verify, task, answer, final_state)
