"""Judging an episode's final state with `posttrain.verify`, the same verifier evaluation uses.

The verifier sees the final answer (the last assistant turn's text) and the env's final state (the answer, the
workspace's files, the transcript). Verifiers are synchronous and may wait on a sandbox, so they run in a worker
thread and the event loop keeps serving other episodes; one registered ``blocking=False`` (pure Python, never
waits: exact, format, structured, refusal) runs on the loop's thread, sparing the hand-off. A task carrying reward
terms (an RL recipe's `rewards:`) is judged by them instead (`posttrain.verify.rewards`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from posttrain.types import Reward, Task


async def judge(task: Task, final_state: dict[str, Any]) -> Reward:
    from posttrain.verify import is_blocking, verify
    from posttrain.verify import REWARD_TERMS_KEY, judge_terms

    answer = final_state.get("answer") or ""
    if task.metadata.get(REWARD_TERMS_KEY):
        return await judge_terms(task, answer, final_state)
    if not is_blocking(task.verifier):
        return verify(task, answer, final_state)
    return await asyncio.to_thread(verify, task, answer, final_state)
