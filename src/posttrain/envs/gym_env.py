"""Gymnasium environments with text observations and actions, as posttrain environments (``env: gym``).

    task.env = "gym"; task.env_args = {"env_id": "MyTextEnv-v0", "seed": 17}
    # reset: the task's messages, then the env's first observation as a user message
    # step:  the policy's turn is the action; the env's next observation is the next user message

An env qualifies when its observations are strings (or it renders text: ``render_mode="ansi"``) and its action
space is `gymnasium.spaces.Text` (the turn's text, stripped, must be in the space) or `Discrete` (the turn is an
integer, or one of ``env.metadata["action_names"]``). An action outside the space ends the episode with the return
so far and ``FailureClass.FORMAT``.

Rewards: each step's reward is the step's ``step_reward`` (the episode's ``process`` component is their mean,
`posttrain.envs.episode`); the outcome is the episode's return (``outcome: return``, the sum of the step rewards)
or its last step's reward (``outcome: final``), or 1/0 by the env's reported success (``outcome: success``: a
sparse outcome beside the dense step rewards, the case process rewards are for). ``passed``: ``info["success"]`` / ``info["is_success"]`` of the
last step when the env reports one, else ``score >= pass_threshold`` (default 1). Episode limits come from the
task (``max_steps``, ``timeout_s``: the recipe's domain arguments); the env's own `TimeLimit` may end it sooner.

Gymnasium is synchronous: make, reset and step run in a worker thread under ``step_timeout_s``; a crash or a
timeout there is an infrastructure failure of the episode (`posttrain.envs.external.guarded`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from posttrain.envs.base import Action, EnvError, Observation, StepResult, environment
from posttrain.envs.external import env_reward, episode_outcome, guarded, observation_text
from posttrain.types import Task


@environment("gym")
class GymTextEnv:
    def __init__(self, env_id: str, env_kwargs: dict[str, Any] | None = None, seed: int | None = None,
                 outcome: str = "return", pass_threshold: float = 1.0, step_timeout_s: float = 30.0,
                 sandbox: Any = None, parser: Any = None):
        if outcome not in ("return", "final", "success"):
            raise EnvError(f"gym env {env_id!r}: outcome must be 'return', 'final' or 'success', got {outcome!r}")
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})
        self.seed = seed
        self.outcome = outcome
        self.pass_threshold = pass_threshold
        self.step_timeout_s = step_timeout_s
        self.env: Any = None
        self.rewards: list[float] = []
        self.success: bool | None = None
        self.answer: str | None = None
        self.invalid_action: str | None = None

    async def reset(self, task: Task) -> Observation:
        import gymnasium

        self.env = await guarded(asyncio.to_thread(gymnasium.make, self.env_id, **self.env_kwargs),
                                 self.step_timeout_s, f"gymnasium.make({self.env_id!r})")
        first, _ = await guarded(asyncio.to_thread(self.env.reset, seed=self.seed), self.step_timeout_s,
                                 f"{self.env_id} reset")
        return Observation(messages=[*(dict(m) for m in task.messages), self._message(first)])

    async def step(self, action: Action) -> StepResult:
        self.answer = action.text
        message = {"role": "assistant", "content": action.text}
        env_action = self._action(action.text)
        if env_action is None:
            self.invalid_action = action.text
            return StepResult(Observation(), done=True, info={"assistant_message": message, "failed": True,
                                                             "final_answer": action.text, "step_reward": 0.0})
        observation, reward, terminated, truncated, info = await guarded(
            asyncio.to_thread(self.env.step, env_action), self.step_timeout_s, f"{self.env_id} step")
        self.rewards.append(float(reward))
        for key in ("success", "is_success"):
            if key in info:
                self.success = bool(info[key])
        done = bool(terminated or truncated)
        info = {"assistant_message": message, "final_answer": action.text, "step_reward": float(reward)}
        return StepResult(Observation(messages=[] if done else [self._message(observation)]), done=done, info=info)

    def _message(self, observation: Any) -> dict[str, Any]:
        if not isinstance(observation, str):
            if getattr(self.env, "render_mode", None) != "ansi":
                raise EnvError(f"gym env {self.env_id!r}: observations are {type(observation).__name__}, not text; "
                               "return str observations or declare render_mode='ansi'")
            observation = self.env.render()
        return {"role": "user", "content": observation_text(observation)}

    def _action(self, text: str) -> Any:
        """The env's action for the turn's text, or None when the text is outside the action space."""
        from gymnasium import spaces

        space, text = self.env.action_space, text.strip()
        if isinstance(space, spaces.Text):
            return text if space.contains(text) else None
        if isinstance(space, spaces.Discrete):
            names = list(self.env.metadata.get("action_names", []))
            if text in names:
                return space.start + names.index(text)
            try:
                value = int(text)
            except ValueError:
                return None
            return value if space.contains(value) else None
        raise EnvError(f"gym env {self.env_id!r}: action space {space} is neither Text nor Discrete")

    def final_state(self) -> dict[str, Any]:
        if self.env is not None:
            self.env.close()
        score, passed = episode_outcome(self.rewards, self.outcome, self.success, self.pass_threshold)
        details: dict[str, Any] = {"env_id": self.env_id, "env_steps": len(self.rewards)}
        if self.invalid_action is not None:
            details["invalid_action"] = self.invalid_action[:200]
        failure = "format" if self.invalid_action is not None else None
        return {"answer": self.answer, "env_reward": env_reward(score, passed and self.invalid_action is None,
                                                                {"env_return": sum(self.rewards)}, details, failure)}
