"""What the adapters of other ecosystems' environments share (Gymnasium, OpenEnv, verifiers).

* `guarded`: every call into the foreign environment (make, reset, step, its rubric) runs under a wall-clock
  limit; a timeout or an exception is a `ToolInfraError` with failure ``infra``, so the episode is masked and
  retried, never scored as the model's 0. (A step that hangs in a worker thread cannot be killed; it is abandoned
  and the episode moves on.)
* `episode_outcome`: the episode's score and verdict from its step rewards, as the recipe's ``outcome`` asks.
* `env_reward`: the final-state entry the ``environment`` verifier (`posttrain.verify.verify_environment`) turns
  into the `Reward`, components kept.
* `observation_text`: the text the policy reads from an observation.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, TypeVar

from posttrain.envs.base import EnvError, ToolInfraError

T = TypeVar("T")


async def guarded(awaitable: Awaitable[T], timeout_s: float, what: str) -> T:
    """`awaitable`'s result; a timeout or any exception becomes an infrastructure failure naming `what`."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        raise ToolInfraError(f"{what} did not answer within {timeout_s:g} s", failure="infra") from None
    except (ToolInfraError, EnvError):
        raise
    except Exception as error:  # the environment's own crash: the system's failure, not the model's
        raise ToolInfraError(f"{what} failed: {type(error).__name__}: {error}", failure="infra") from error


def episode_outcome(rewards: list[float], kind: str, success: bool | None, pass_threshold: float
                    ) -> tuple[float, bool]:
    """The episode's (score, passed): the score is the return (`kind` ``return``: the sum of the step rewards),
    the last step's reward (``final``) or the env's reported success as 1/0 (``success``); passed is that
    success when the env reported one, else ``score >= pass_threshold``."""
    if kind == "success":
        score = float(bool(success))
    else:
        score = sum(rewards) if kind == "return" else (rewards[-1] if rewards else 0.0)
    return score, success if success is not None else score >= pass_threshold


def env_reward(score: float, passed: bool | None = None, components: dict[str, float] | None = None,
               details: dict[str, Any] | None = None, failure: str | None = None) -> dict[str, Any]:
    """The ``final_state["env_reward"]`` entry (`posttrain.verify.environment`); `passed` None: score >= 1."""
    entry: dict[str, Any] = {"score": float(score), "components": dict(components or {}),
                             "details": dict(details or {})}
    if passed is not None:
        entry["passed"] = bool(passed)
    if failure is not None:
        entry["failure"] = failure
    return entry


def observation_text(observation: Any, field: str | None = None) -> str:
    """A string observation as it is; a mapping's `field` (or its one text field); anything else as JSON."""
    if isinstance(observation, str):
        return observation
    if isinstance(observation, dict):
        if field is not None:
            if field not in observation:
                raise EnvError(f"the observation has no field {field!r} (fields: {', '.join(map(str, observation))})")
            return str(observation[field])
        texts = [v for k, v in observation.items() if isinstance(v, str) and k != "metadata"]
        if len(texts) == 1:
            return texts[0]
    import json

    return json.dumps(observation, sort_keys=True, default=str)
