"""Calculator tool use, multi-turn: the answer needs a calculator call, its result, then the answer.

    user:      What is 4821*397?
    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "4821*397"}}</tool_call>
    tool:      1913937
    assistant: 1913937

A ~3M-parameter model cannot multiply 4-digit numbers in its head, but it can learn this short, regular format:
copy the expression into the call, then copy the tool's result. Levels: 1 = 3-digit x 2-digit, 2 = 3 x 3,
3 = 4 x 3, 4 = 4 x 4, 5 = ``a*b+c`` / ``a*b-c`` (4 x 3 digits, 4-digit c). Judged by ``exact`` on the final answer;
the episode runs in the ``tools`` env with at most `max_steps` turns (room for a retry after a bad call).

`show_tool_schemas` (default off, to keep the tiny model's prompts short) renders the tool's JSON schema in the
prompt through the chat template's ``tools`` argument, as real instruct models expect.
"""

from __future__ import annotations

import random

from posttrain.data import SFTSample
from posttrain.envs import evaluate_expression, tool_schemas
from posttrain.tasks.base import TaskError, demo_conversation, domain, task_id, tool_call_message, tool_result_message
from posttrain.types import Task

_SHAPES = {1: (3, 2), 2: (3, 3), 3: (4, 3), 4: (4, 4), 5: (4, 3)}


@domain("calculator")
class Calculator:
    name = "calculator"
    max_level = 5

    def __init__(self, max_steps: int = 3, show_tool_schemas: bool = False, system_prompt: str | None = None):
        if max_steps < 2:
            raise TaskError("calculator: max_steps must be at least 2 (a call, then the answer)")
        self.max_steps = max_steps
        self.show_tool_schemas = show_tool_schemas
        self.system_prompt = system_prompt

    def make_task(self, rng: random.Random, level: int) -> Task:
        digits_a, digits_b = _SHAPES[level]
        a = rng.randint(10 ** (digits_a - 1), 10**digits_a - 1)
        b = rng.randint(10 ** (digits_b - 1), 10**digits_b - 1)
        expression = f"{a}*{b}"
        if level == 5:
            expression += f"{rng.choice('+-')}{rng.randint(1000, 9999)}"
        answer = evaluate_expression(expression)
        messages = [{"role": "user", "content": f"What is {expression}?"}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return Task(
            id=task_id(self.name, expression),
            domain=self.name,
            difficulty=level,
            messages=messages,
            verifier="exact",
            verifier_args={"answer": answer},
            env="tools",
            env_args={"tool_schemas_in_prompt": self.show_tool_schemas},
            tools=["calculator"],
            max_steps=self.max_steps,
            timeout_s=30.0,
            metadata={"problem_key": expression, "expression": expression, "answer": answer},
        )

    def demonstration(self, task: Task) -> SFTSample:
        expression, answer = task.metadata["expression"], task.metadata["answer"]
        turns = [
            tool_call_message("calculator", {"expression": expression}),
            tool_result_message("calculator", answer),
            {"role": "assistant", "content": answer},
        ]
        tools = tool_schemas(task.tools) if task.env_args.get("tool_schemas_in_prompt") else None
        return demo_conversation(task, turns, trace=None, tools=tools)
