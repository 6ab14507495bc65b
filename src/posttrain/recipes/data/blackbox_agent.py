"""A black-box agent for `grpo-agent-blackbox`: an ordinary OpenAI-client tool loop, nothing posttrain-specific.

posttrain starts it once per episode inside the sandbox with OPENAI_BASE_URL (the episode's endpoint of the
policy being trained), OPENAI_API_KEY and POSTTRAIN_TASK (a JSON file with the task's messages). It offers the
model a calculator, runs the calls the model makes, sends back the results, and prints the model's last answer,
which the task's verifier judges. Any agent written against the OpenAI API works the same way.

    python blackbox_agent.py [MAX_TURNS]
"""

import ast
import json
import operator
import os
import sys

from openai import OpenAI

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg}


def calculate(expression: str) -> str:
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / ( )")

    try:
        result = value(ast.parse(str(expression), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as error:
        return f"error: {error}"
    return str(int(result)) if float(result).is_integer() else str(result)


def main() -> None:
    max_turns = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    client = OpenAI(max_retries=0)
    with open(os.environ["POSTTRAIN_TASK"]) as handle:
        messages = list(json.load(handle)["messages"])
    answer = ""
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        answer = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "name": "calculator",
                             "content": calculate(expression)})
    print(answer)


if __name__ == "__main__":
    main()
