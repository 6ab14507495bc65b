"""Scripted policies for the env and task tests: an InferenceEngine whose samples are written in advance.

`ScriptedEngine` implements the `InferenceEngine` protocol: each request's next turn comes from a script (per
task id, looked up from the request id ``"<task id>:<turn>"``), is tokenized to ids, and is returned with
per-token logprobs and the engine's policy version; a turn longer than ``max_new_tokens`` is cut and finishes
with ``"length"``, like a real engine. `demo_turns` turns a demonstration into the assistant texts a policy
would sample to replay it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from posttrain.types import Completion, GenerationRequest, InferenceEngine, SamplingParams

Script = list[str] | Callable[[str, int], str]


class ScriptedEngine:
    def __init__(self, tokenizer, scripts: dict[str, Script] | Script, version: int = 7,
                 fail_on_turn: int | None = None, delay_s: dict[int, float] | None = None):
        self.tokenizer = tokenizer
        self.scripts = scripts
        self.version = version
        self.fail_on_turn = fail_on_turn
        self.delay_s = delay_s or {}
        self.returned: dict[str, list[list[int]]] = {}  # request id prefix -> the ids handed out, in order
        self.calls: list[int] = []  # batch size of every generate call

    @property
    def policy_version(self) -> int:
        return self.version

    def update_weights(self, state, version: int) -> None:
        self.version = version

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[list[Completion]]:
        self.calls.append(len(requests))
        return [[self._complete(request, sampling)] for request in requests]

    def _complete(self, request: GenerationRequest, sampling: SamplingParams) -> Completion:
        task_id, turn = request.request_id.rsplit(":", 1)
        turn = int(turn)
        if self.fail_on_turn == turn:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if turn in self.delay_s:
            time.sleep(self.delay_s[turn])
        script = self.scripts.get(task_id) if isinstance(self.scripts, dict) else self.scripts
        prompt = self.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
        text = script(prompt, turn) if callable(script) else script[min(turn, len(script) - 1)]
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        finish = "stop"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        logprobs = [-0.01 * (i + 1) for i in range(len(ids))]
        self.returned.setdefault(task_id, []).append(ids)
        return Completion(token_ids=ids, text=self.tokenizer.decode(ids, skip_special_tokens=False),
                          logprobs=logprobs, finish_reason=finish, policy_version=self.version,
                          request_id=request.request_id)


class SlowAsyncPolicy:
    """An async policy (like the rollout batcher) that takes `delay_s` per call and records concurrency."""

    def __init__(self, engine: ScriptedEngine, delay_s: float = 0.05):
        self.engine = engine
        self.delay_s = delay_s
        self.in_flight = 0
        self.max_in_flight = 0

    async def generate(self, request: GenerationRequest, sampling: SamplingParams) -> list[Completion]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            return self.engine.generate([request], sampling)[0]
        finally:
            self.in_flight -= 1


class GatedPolicy:
    """An async policy whose first call of each episode is held until `expected` calls are waiting on it at once:
    a loop that runs episodes concurrently fills the gate, one that runs them one after another never does (its
    first episode waits the gate's whole `patience_s`, then fails). No wall-clock bound, so load cannot fail it."""

    def __init__(self, engine: ScriptedEngine, expected: int, patience_s: float = 60.0):
        self.engine, self.expected, self.patience_s = engine, expected, patience_s
        self.gate = asyncio.Event()
        self.in_flight = 0
        self.waiting_when_opened = 0
        self.events: list[tuple[str, str]] = []  # ("start" | "end", task id), in the order they happened

    async def generate(self, request, sampling):
        task_id, turn = request.request_id.rsplit(":", 1)
        self.in_flight += 1
        try:
            if turn == "0":
                self.events.append(("start", task_id))
                if self.in_flight >= self.expected and not self.gate.is_set():
                    self.waiting_when_opened = self.in_flight
                    self.gate.set()
                await asyncio.wait_for(self.gate.wait(), self.patience_s)
            else:
                self.events.append(("end", task_id))
            return self.engine.generate([request], sampling)[0]
        finally:
            self.in_flight -= 1


def demo_turns(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[str]:
    """The text of every assistant turn of `messages` as the chat template renders it (what SFT teaches)."""
    turns = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = tokenizer.apply_chat_template(messages[:i], tools=tools, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False)
        assert full.startswith(head)
        turns.append(full[len(head):])
    return turns


def test_scripted_engine_is_an_inference_engine(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, ["12<|end|>"])
    assert isinstance(engine, InferenceEngine)
    [[completion]] = engine.generate([GenerationRequest([1, 2], request_id="t:0")], SamplingParams())
    assert tiny_tokenizer.decode(completion.token_ids) == "12<|end|>"
    assert len(completion.logprobs) == len(completion.token_ids) and completion.finish_reason == "stop"
    [[cut]] = engine.generate([GenerationRequest([1], request_id="t:0")], SamplingParams(max_new_tokens=1))
    assert cut.finish_reason == "length" and len(cut.token_ids) == 1
