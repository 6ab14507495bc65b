"""The single-turn environment: the prompt, one completion, done. The verifier judges the completion."""

from __future__ import annotations

from typing import Any

from posttrain.envs.base import Action, Observation, StepResult, environment
from posttrain.types import Task


@environment("single_turn")
class SingleTurnEnv:
    def __init__(self, sandbox: Any = None, parser: Any = None, **options: Any):
        self.options = options
        self.task: Task | None = None
        self.answer: str | None = None

    async def reset(self, task: Task) -> Observation:
        self.task, self.answer = task, None
        return Observation(messages=[dict(m) for m in task.messages])

    async def step(self, action: Action) -> StepResult:
        self.answer = action.text
        message = {"role": "assistant", "content": action.text}
        return StepResult(Observation(), done=True, info={"assistant_message": message, "final_answer": action.text})

    def final_state(self) -> dict[str, Any]:
        return {"answer": self.answer}
