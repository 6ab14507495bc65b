"""Reward functions of the packaged GRPO recipes: plain `(completion, task) -> float`, as in TRL.

A recipe names one as ``{function: "${recipe_dir}/grpo_rewards.py:brevity", weight: 0.1}``; copy this file beside
your own recipe (`posttrain recipes grpo-math --copy DEST` does) and write your own the same way.
"""

from __future__ import annotations

from typing import Any


def brevity(completion: str, task: Any) -> float:
    """0 for an answer of up to 32 characters, down to -1 at 128: say it, then stop."""
    return -min(1.0, max(0, len(completion) - 32) / 96)


async def tool_use(completion: str, task: Any) -> float:
    """An async reward (any awaitable works): 1 when the answer is a bare number, as the calculator tasks ask."""
    return 1.0 if completion.strip().lstrip("-").isdigit() else 0.0
