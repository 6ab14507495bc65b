"""The ``environment`` verifier: the outcome an external environment judged itself (Gymnasium, OpenEnv, verifiers).

An adapter environment (`posttrain.envs.gym_env`, `openenv_env`, `verifiers_env`) puts its environment's own
judgement in its final state as ``final_state["env_reward"]``:

    {"score": float, "passed": bool, "components": {name: float}, "details": {...}, "failure": "format"}

and this verifier turns it into the `Reward`, keeping every component. It reads nothing the model wrote: the
environment computed the score (its rubric, its step rewards), outside the model's reach. A final state without
``env_reward`` means the environment never reported an outcome: an infrastructure failure, never a 0.
"""

from __future__ import annotations

import math
from typing import Any

from posttrain.types import FailureClass, Reward
from posttrain.verify.registry import verifier

ENV_REWARD_KEY = "env_reward"


@verifier("environment", blocking=False)
def verify_environment(completion: str, *, final_state: dict[str, Any] | None = None,
                       pass_threshold: float | None = None) -> Reward:
    """The environment's reward; ``passed`` is the environment's own verdict, or ``score >= pass_threshold``."""
    judged = (final_state or {}).get(ENV_REWARD_KEY)
    if not isinstance(judged, dict) or "score" not in judged:
        return Reward(score=0.0, passed=False, failure=FailureClass.INFRA,
                      details={"error": "the environment reported no reward"})
    score = float(judged["score"])
    if not math.isfinite(score):
        return Reward(score=0.0, passed=False, failure=FailureClass.INFRA,
                      details={"error": f"the environment reported a non-finite reward ({score})"})
    if pass_threshold is not None:
        passed = score >= pass_threshold
    else:
        passed = bool(judged.get("passed", score >= 1.0))
    components = {str(k): float(v) for k, v in dict(judged.get("components") or {}).items()}
    failure = FailureClass.NONE if passed else FailureClass.WRONG_ANSWER
    if not passed and judged.get("failure") == FailureClass.FORMAT.value:  # e.g. an action the env's space rejects
        failure = FailureClass.FORMAT
    return Reward(score=score, passed=passed, failure=failure, components=components,
                  details=dict(judged.get("details") or {}))
