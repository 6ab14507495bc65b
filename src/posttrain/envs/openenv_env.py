"""OpenEnv environment servers as posttrain environments (``env: openenv``), driven through OpenEnv's own client.

    task.env = "openenv"; task.env_args = {"base_url": "http://127.0.0.1:8000", "seed": 3, "action_field": "message"}

Each episode opens its own session on the server (`openenv.GenericEnvClient`: OpenEnv's WebSocket protocol on the
server's HTTP port), resets it (with ``seed`` and ``reset_kwargs``), and sends each policy turn as the action
``{action_field: text}``. The observation's ``observation_field`` (or its one text field) is the next user
message. The server's step rewards are the steps' ``step_reward`` (their mean is the ``process`` component); the
outcome is their sum (``outcome: return``) or the last one (``outcome: final``); ``passed`` is
``score >= pass_threshold``, unless the observation has a boolean ``success`` field (OpenEnv does not send an
observation's ``metadata`` to the client).

A server that cannot be reached, refuses a session, crashes, answers an error or does not answer within
``step_timeout_s`` makes the episode an infrastructure failure (masked and retried, never a 0).
"""

from __future__ import annotations

import asyncio
from typing import Any

from posttrain.envs.base import Action, EnvError, Observation, StepResult, environment
from posttrain.envs.external import env_reward, episode_outcome, guarded, observation_text
from posttrain.types import Task


@environment("openenv")
class OpenEnvEnv:
    def __init__(self, base_url: str, seed: int | None = None, reset_kwargs: dict[str, Any] | None = None,
                 action_field: str = "message", observation_field: str | None = None, outcome: str = "return",
                 pass_threshold: float = 1.0, connect_timeout_s: float = 10.0, step_timeout_s: float = 30.0,
                 sandbox: Any = None, parser: Any = None):
        if outcome not in ("return", "final"):
            raise EnvError(f"openenv env at {base_url}: outcome must be 'return' or 'final', got {outcome!r}")
        self.base_url = base_url
        self.reset_kwargs = {**({"seed": seed} if seed is not None else {}), **dict(reset_kwargs or {})}
        self.action_field = action_field
        self.observation_field = observation_field
        self.outcome = outcome
        self.pass_threshold = pass_threshold
        self.connect_timeout_s = connect_timeout_s
        self.step_timeout_s = step_timeout_s
        self.client: Any = None
        self.rewards: list[float] = []
        self.success: bool | None = None
        self.answer: str | None = None

    async def reset(self, task: Task) -> Observation:
        from openenv import GenericEnvClient

        self.client = GenericEnvClient(base_url=self.base_url, connect_timeout_s=self.connect_timeout_s,
                                       message_timeout_s=self.step_timeout_s)
        try:
            await guarded(self.client.connect(), self.connect_timeout_s + 1.0, f"OpenEnv server {self.base_url}")
            result = await guarded(self.client.reset(**self.reset_kwargs), self.step_timeout_s,
                                   f"OpenEnv reset at {self.base_url}")
        except Exception:
            await self._close()  # a failed episode does not keep its session open
            raise
        return Observation(messages=[*(dict(m) for m in task.messages), self._message(result.observation)])

    async def step(self, action: Action) -> StepResult:
        self.answer = action.text
        try:
            result = await guarded(self.client.step({self.action_field: action.text}), self.step_timeout_s,
                                   f"OpenEnv step at {self.base_url}")
        except Exception:
            await self._close()
            raise
        info: dict[str, Any] = {"assistant_message": {"role": "assistant", "content": action.text},
                                "final_answer": action.text}
        if result.reward is not None:
            self.rewards.append(float(result.reward))
            info["step_reward"] = float(result.reward)
        if isinstance(result.observation, dict) and isinstance(result.observation.get("success"), bool):
            self.success = result.observation["success"]
        if result.done:
            await self._close()
            return StepResult(Observation(), done=True, info=info)
        return StepResult(Observation(messages=[self._message(result.observation)]), done=False, info=info)

    def _message(self, observation: Any) -> dict[str, Any]:
        return {"role": "user", "content": observation_text(observation, self.observation_field)}

    async def _close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), self.connect_timeout_s)
            except Exception:  # noqa: BLE001 - the episode is over; a session that will not close is the server's
                pass

    def final_state(self) -> dict[str, Any]:
        if self.client is not None:  # ended by the task's step limit: close the session without waiting
            asyncio.get_running_loop().create_task(self._close())
        score, passed = episode_outcome(self.rewards, self.outcome, self.success, self.pass_threshold)
        return {"answer": self.answer, "env_reward": env_reward(score, passed, {"env_return": sum(self.rewards)},
                                                                {"server": self.base_url,
                                                                 "env_steps": len(self.rewards)})}
