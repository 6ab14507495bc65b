"""A black-box agent with no dependencies: one chat completion over plain HTTP (the standard library), its reply
printed as the answer. Nothing posttrain-specific: it reads OPENAI_BASE_URL, OPENAI_API_KEY and the task's
messages (POSTTRAIN_TASK), as any OpenAI-API program would.

`grpo-agent-blackbox-digits` trains through it rather than through `blackbox_agent.py` because of what a process
costs on a small CPU: importing the `openai` client takes ~1 s of CPU per episode, which on a shared 2-core
machine made the agent's start-up, not the model, most of an RL step.

    python http_agent.py
"""

import json
import os
import urllib.request


def main() -> None:
    with open(os.environ["POSTTRAIN_TASK"]) as handle:
        messages = json.load(handle)["messages"]
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": messages}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the endpoint, never an HTTP proxy
    with opener.open(request) as response:
        reply = json.load(response)
    print(reply["choices"][0]["message"].get("content") or "")


if __name__ == "__main__":
    main()
