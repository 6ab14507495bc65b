"""A tiny model trained for a few seconds to call the calculator tool, saved as a checkpoint (serve/chat tests)."""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.envs.tools import get_tool
from posttrain.models import build_tiny_model, save_model_dir

# The built-in tool's own schema: `posttrain chat --tools calculator` offers the model exactly this.
CALCULATOR = get_tool("calculator").schema()
QUESTION = "What is 2+3? Use the calculator."
CALL_TEXT = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
ANSWER = "The answer is 5."


def conversations() -> list[tuple[list[dict], list[dict] | None]]:
    """(messages, tools) the model learns by heart: a tool call, then the answer after the tool's result."""
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}]}
    user = {"role": "user", "content": QUESTION}
    return [
        ([user, call], [CALCULATOR]),
        ([user, call, {"role": "tool", "content": "5"}, {"role": "assistant", "content": ANSWER}], [CALCULATOR]),
        ([{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there, friend."}], None),
    ]


_TRAINED: dict[tuple[int, int, int], Path] = {}


def train_tool_model(tokenizer, directory: Path, steps: int = 100, seed: int = 0) -> Path:
    """Train once per test session (per tokenizer, steps, seed): later calls get the first directory."""
    key = (id(tokenizer), steps, seed)
    if key not in _TRAINED:
        _TRAINED[key] = _train_with_one_thread(tokenizer, directory, steps, seed)
    return _TRAINED[key]


def _train_with_one_thread(tokenizer, directory: Path, steps: int, seed: int) -> Path:
    # One thread: on a loaded shared CPU, torch's OpenMP threads spinning against other processes made this
    # ~100x slower (tens of seconds -> over ten minutes).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(tokenizer, directory, steps, seed)
    finally:
        torch.set_num_threads(threads)


def _train(tokenizer, directory: Path, steps: int, seed: int) -> Path:
    model = build_tiny_model("tiny-1m", tokenizer, seed=seed)
    rows = []
    for messages, tools in conversations():
        ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True)
        rows.append(torch.tensor(list(ids["input_ids"] if hasattr(ids, "keys") else ids)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            loss = sum(model(input_ids=row[None], labels=row[None]).loss for row in rows) / len(rows)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    save_model_dir(directory, model, tokenizer)
    return directory
