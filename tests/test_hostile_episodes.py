"""What a model writes never becomes an infrastructure failure.

An infrastructure failure is retried or masked, never scored: so any text a policy can write that makes the
episode loop, a tool or the verifier crash would hide that episode's reward, and a policy could learn to write it
whenever it is unsure. Each case below is a tool call or workspace a model can produce (nested past the JSON
parser's depth, a lone surrogate through a JSON escape, a path the work dir cannot hold, a file under a file); each
must come back as a tool error the model sees and an episode judged as usual. All of them crashed or returned
`SANDBOX`/`INFRA` before 2026-12-04.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from posttrain.envs import make_environment
from posttrain.envs.base import Action
from posttrain.tasks import get_domain, sample_tasks
from posttrain.verify import verify

pytestmark = pytest.mark.bwrap  # the repo_fix episodes run their tests and verifier in the sandbox


def call(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


NESTED = 5000
TURNS = {
    "calculator": [
        '<tool_call>{"name": "calculator", "arguments": ' + '{"a": ' * NESTED + "1" + "}" * (NESTED + 1)
        + "</tool_call>",
        "<tool_call>" + "[" * NESTED + "</tool_call>",
        '<tool_call>{"name": "calculator", "arguments": "' + "[" * NESTED + '"}</tool_call>',
    ],
    "repo_fix": [
        call("write_file", {"path": "notes.txt", "content": "\ud800"}),  # json.dumps writes it as an escape
        call("write_file", {"path": "x\ud800.py", "content": "y = 1\n"}),
        call("write_file", {"path": "a/" * 2000 + "b.py", "content": "y = 1\n"}),
        call("write_file", {"path": "n" * 300 + ".py", "content": "y = 1\n"}),
        call("write_file", {"path": "shop/pricing.py/x.py", "content": "y = 1\n"}),  # shop/pricing.py is a file
    ],
}


def episode(domain: str, text: str) -> tuple[str, object]:
    async def run():
        task = sample_tasks(get_domain(domain), 1, level=[1], split="train", seed=0)[0]
        env = make_environment(task)
        await env.reset(task)
        step = await env.step(Action(text))
        observation = " ".join(str(m.get("content")) for m in step.observation.messages)
        if "run_tests" in task.tools:  # the project's tests then run on the workspace the call left
            await env.step(Action(call("run_tests", {})))
        return observation, verify(task, "done", env.final_state())

    return asyncio.run(run())


@pytest.mark.parametrize("domain, text", [(d, t) for d, texts in TURNS.items() for t in texts],
                         ids=lambda value: value if value in TURNS else None)
def test_a_hostile_tool_call_is_a_tool_error_and_the_episode_is_judged(domain, text):
    observation, reward = episode(domain, text)
    assert "error" in observation, observation[:300]
    assert not reward.is_infrastructure_failure, reward.details
