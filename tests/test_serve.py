"""`posttrain serve`: a real uvicorn server on 127.0.0.1 driven by the official `openai` client.

The model is a tiny Llama trained for a few seconds to call the calculator (tests/serve_support.py) and
saved as a checkpoint; the server loads it from disk like `posttrain serve` does.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from posttrain.rollout.continuous import ContinuousBatcher, StreamRequest
from posttrain.serve import HFBackend, free_port, make_backend, start_server
from posttrain.serve.protocol import MAX_SEQUENCES_PER_REQUEST
from posttrain.types import GenerationRequest, SamplingParams
from serve_support import ANSWER, CALCULATOR, QUESTION, train_tool_model

MODEL = "tiny-tools"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer) -> Path:
    return train_tool_model(tiny_tokenizer, tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(checkpoint):
    backend = make_backend(checkpoint, precision="fp32", num_threads=1)
    with start_server(backend, MODEL) as handle:
        yield handle


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _alone(server, messages: list[dict], max_tokens: int) -> str:
    """What the engine generates for this chat on its own (offline `generate`, greedy)."""
    engine = server.backend.batcher.engine
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    sampling = SamplingParams(max_new_tokens=max_tokens, temperature=0, include_stop_in_output=False)
    return engine.generate([GenerationRequest(ids)], sampling)[0][0].text


def _ask_all(url: str, prompts: list[list[dict]], max_tokens: int = 16) -> list[str]:
    """Every prompt at once from one async client, every other one streamed; the greedy texts, in order."""
    async def ask_all():
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(messages, stream):
            if not stream:
                reply = await aclient.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                              max_tokens=max_tokens)
                return reply.choices[0].message.content
            chunks = await aclient.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                           max_tokens=max_tokens, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

        try:
            return await asyncio.gather(*(one(m, i % 2 == 0) for i, m in enumerate(prompts)))
        finally:
            await aclient.close()

    return asyncio.run(ask_all())


def _get(url: str, headers: dict | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _post(url: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


# ---- the endpoints ---------------------------------------------------------------------------------------


def test_models_health_and_a_greedy_chat_equal_to_the_engine_alone(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert _get(server.url + "/health")[0] == 200
    reply = client.chat.completions.create(model=MODEL, messages=_user("Say hello."), temperature=0, max_tokens=24)
    assert reply.choices[0].message.content == _alone(server, _user("Say hello."), 24)
    assert reply.choices[0].message.content.startswith("Hello there")
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 0


def test_async_and_streaming_chat_give_the_same_text(server, client):
    async def both():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        whole = await aclient.chat.completions.create(model=MODEL, messages=_user("Say hello."), temperature=0,
                                                      max_tokens=24)
        stream = await aclient.chat.completions.create(model=MODEL, messages=_user("Say hello."), temperature=0,
                                                       max_tokens=24, stream=True,
                                                       stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        await aclient.close()
        return whole, chunks

    whole, chunks = asyncio.run(both())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # streamed in pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_samples_seeds_and_stop(client):
    messages = _user("Tell me something.")
    first = client.chat.completions.create(model=MODEL, messages=messages, n=3, temperature=1.0, seed=7,
                                           max_tokens=12)
    again = client.chat.completions.create(model=MODEL, messages=messages, n=3, temperature=1.0, seed=7,
                                           max_tokens=12)
    texts = [c.message.content for c in first.choices]
    assert len(texts) == 3 and [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]  # a seed repeats
    assert len(set(texts)) > 1  # the n samples are different draws
    greedy = client.chat.completions.create(model=MODEL, messages=_user("Say hello."), temperature=0, max_tokens=24)
    cut = client.chat.completions.create(model=MODEL, messages=_user("Say hello."), temperature=0, max_tokens=24,
                                         stop=["there"])
    assert cut.choices[0].message.content == greedy.choices[0].message.content.split("there")[0]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs_and_top_logprobs(client):
    reply = client.chat.completions.create(model=MODEL, messages=_user("Say hello."), temperature=0, max_tokens=6,
                                           logprobs=True, top_logprobs=3)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    assert "".join(e.token for e in entries).startswith("Hello")


def test_a_tool_call_round_trip(client):
    messages = _user(QUESTION)
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR], temperature=0,
                                           max_tokens=60)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "2+3"}
    assert not choice.message.content
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR], temperature=0,
                                            max_tokens=30)
    assert second.choices[0].message.content == ANSWER
    assert second.choices[0].finish_reason == "stop"


def test_a_streamed_tool_call_and_a_forced_tool_choice(client):
    """A call streams as OpenAI's does: id, type and name first, then argument fragments that the openai
    client's own stream accumulation (`chat.completions.stream`) puts back into the call a plain reply gives."""
    whole = client.chat.completions.create(model=MODEL, messages=_user(QUESTION), tools=[CALCULATOR],
                                           temperature=0, max_tokens=60).choices[0].message.tool_calls
    with client.chat.completions.stream(model=MODEL, messages=_user(QUESTION), tools=[CALCULATOR],
                                        temperature=0, max_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    deltas = [tc for e in events if e.type == "chunk" and e.chunk.choices
              for tc in (e.chunk.choices[0].delta.tool_calls or [])]
    first, *rest = deltas
    assert first.id and first.type == "function" and first.function.name == "calculator"
    assert all(d.id is None and d.function.name is None and d.index == 0 for d in rest)
    assert "".join([first.function.arguments or "", *(d.function.arguments for d in rest)]) \
        == final.choices[0].message.tool_calls[0].function.arguments
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == whole[0].function.name == "calculator"
    assert json.loads(call.function.arguments) == json.loads(whole[0].function.arguments) == {"expression": "2+3"}
    assert not final.choices[0].message.content  # the call's text is not content
    assert final.choices[0].finish_reason == "tool_calls"
    assert [e.type for e in events].count("tool_calls.function.arguments.done") == 1
    forced = client.chat.completions.create(
        model=MODEL, messages=_user(QUESTION), tools=[CALCULATOR], temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "calculator"}})
    assert forced.choices[0].message.tool_calls[0].function.name == "calculator"


def test_tool_call_deltas_stream_the_name_then_the_arguments_as_written():
    from posttrain.serve.prompting import ToolCallDeltas, merge_call_deltas

    text = ('Let me. <tool_call>{"name": "calc\\u00e9", "arguments": {"expression": "2+\\"3}\\"", "n": [1, {"a": 2}]}}'
            '</tool_call> and <tool_call>{"name": "echo", "arguments": "{\\"x\\": 1}"}</tool_call>'
            '<tool_call>{"name": 5}</tool_call>')
    calls = ToolCallDeltas()
    deltas = [d for end in range(len(text) + 1) for d in calls.update(text[:end])] + calls.finish(text)
    assert deltas[0] == {"index": 0, "id": deltas[0]["id"], "type": "function",
                         "function": {"name": "calcé", "arguments": ""}}
    fragments = [d for d in deltas[1:] if d["index"] == 0]
    assert len(fragments) > 10 and all(set(d) == {"index", "function"} for d in fragments)
    arguments = "".join(d["function"]["arguments"] for d in fragments)
    assert json.loads(arguments) == {"expression": '2+"3}"', "n": [1, {"a": 2}]}
    assert arguments.endswith("}]}")  # the fragments stop at the object's end, not the call's
    echo = [d for d in deltas if d["index"] == 1]  # arguments as a JSON string: sent whole at the end
    assert echo[0]["function"] == {"name": "echo", "arguments": ""}
    assert [json.loads(d["function"]["arguments"]) for d in echo[1:]] == [{"x": 1}]
    assert max(d["index"] for d in deltas) == 1  # the malformed third block is no call
    merged = merge_call_deltas(deltas)  # one chunk carrying it all: one delta per call
    assert [d["index"] for d in merged] == [0, 1] and merged[0]["function"]["arguments"] == arguments


def test_text_completions(client):
    reply = client.completions.create(model=MODEL, prompt=["<|user|>Say hello.<|end|><|assistant|>", "1+1="],
                                      temperature=0, max_tokens=8, logprobs=2)
    assert len(reply.choices) == 2
    assert reply.choices[0].text.startswith("Hello")
    assert len(reply.choices[0].logprobs.tokens) == len(reply.choices[0].logprobs.token_logprobs) > 0
    streamed = client.completions.create(model=MODEL, prompt="<|user|>Say hello.<|end|><|assistant|>",
                                         temperature=0, max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == reply.choices[0].text


# ---- bad requests ----------------------------------------------------------------------------------------


def test_bad_requests_get_openai_errors_and_the_server_stays_up(server, client):
    cases = [
        (dict(model="nope", messages=_user("hi")), 404, "model"),
        (dict(model=MODEL, messages=_user("hi " * 3000)), 400, "context"),
        (dict(model=MODEL, messages=_user("hi"), max_tokens=5000), 400, "context"),
        (dict(model=MODEL, messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
        (dict(model=MODEL, messages=[{"role": "user"}]), 400, "content"),
        (dict(model=MODEL, messages=[]), 400, "messages"),
        (dict(model=MODEL, messages=_user("hi"), temperature=-1), 400, "temperature"),
        (dict(model=MODEL, messages=_user("hi"), top_p=0), 400, "top_p"),
        (dict(model=MODEL, messages=_user("hi"), n=0), 400, "n"),
        (dict(model=MODEL, messages=_user("hi"), top_logprobs=3), 400, "top_logprobs"),
        (dict(model=MODEL, messages=_user("hi"), tool_choice="required"), 400, "tool"),
        (dict(model=MODEL, messages=_user("hi"), frequency_penalty=1.0), 400, "penalt"),
        (dict(model=MODEL, messages=_user("hi"), bogus_field=1), 400, "bogus_field"),
        # strict types, as OpenAI's: none of these is coerced into a request the client did not write
        (dict(model=MODEL, messages=_user("hi"), max_tokens="5"), 400, "max_tokens"),
        (dict(model=MODEL, messages=_user("hi"), stream="yes"), 400, "stream"),
        (dict(model=MODEL, messages=_user("hi"), n=2.0), 400, "n"),
        (dict(model=MODEL, messages=_user("hi"), logprobs=1), 400, "logprobs"),
        (dict(model=MODEL, messages=_user("hi"), temperature="0.5"), 400, "temperature"),
    ]
    for body, status, words in cases:
        code, payload = _post(server.url + "/v1/chat/completions", body)
        assert code == status, (body, payload)
        assert set(payload["error"]) >= {"message", "type", "param", "code"}
        assert words in payload["error"]["message"], payload
    for field, value in [("max_tokens", "5"), ("stream", "yes"), ("seed", True)]:
        code, payload = _post(server.url + "/v1/completions", {"model": MODEL, "prompt": "hi", field: value})
        assert code == 400 and payload["error"]["param"] == field, payload
    # a whole-number temperature is a number: accepted, as OpenAI accepts it
    code, payload = _post(server.url + "/v1/chat/completions", dict(model=MODEL, messages=_user("hi"), temperature=1,
                                                                     max_tokens=2))
    assert code == 200, payload
    code, payload = _post(server.url + "/v1/chat/completions", b"{not json")
    assert code == 400 and "JSON" in payload["error"]["message"]
    code, payload = _post(server.url + "/v1/chat/completions", b"[" * 100_000)  # past the JSON parser's depth
    assert code == 400 and "parsing the body" in payload["error"]["message"], payload
    deep_call = {"type": "function", "id": "c1", "function": {"name": "calculator", "arguments": "[" * 100_000}}
    code, payload = _post(server.url + "/v1/chat/completions", dict(model=MODEL, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [deep_call]}]))
    assert code == 400 and "arguments are not JSON" in payload["error"]["message"], payload
    code, payload = _post(server.url + "/v1/completions", {"model": MODEL, "prompt": [[99999]]})
    assert code == 400 and "token ids" in payload["error"]["message"]
    # a request's sequences are bounded (prompts x n): 100,000 prompts were all tokenized and queued at once
    code, payload = _post(server.url + "/v1/completions", {"model": MODEL, "prompt": ["hi"] * 100_000})
    assert code == 400 and "100000 prompts x n=1 ask for 100000 sequences" in payload["error"]["message"], payload
    code, payload = _post(server.url + "/v1/completions", {"model": MODEL, "prompt": ["hi"] * 5, "n": 64})
    assert code == 400 and f"at most {MAX_SEQUENCES_PER_REQUEST} per request" in payload["error"]["message"]
    code, payload = _post(server.url + "/v1/completions", {"model": MODEL, "prompt": ["hi"] * 4, "n": 64,
                                                           "max_tokens": 1})
    assert code == 200 and len(payload["choices"]) == MAX_SEQUENCES_PER_REQUEST, payload
    # a JSON escape of a lone surrogate is text no tokenizer can encode (it was a 500 from the tokenizer)
    for path, body in [("/v1/chat/completions", b'{"model": "tiny-tools", "messages": [{"role": "user", '
                                                 b'"content": "hi \\ud800"}]}'),
                       ("/v1/completions", b'{"model": "tiny-tools", "prompt": ["ok", "\\udc80"]}')]:
        code, payload = _post(server.url + path, body)
        assert code == 400 and "Unicode" in payload["error"]["message"], payload
        assert payload["error"]["param"] in ("messages.0.content", "prompt.1"), payload
    assert _get(server.url + "/v1/nothing")[0] == 404
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=_user("hi"))
    assert client.chat.completions.create(model=MODEL, messages=_user("hi"), max_tokens=2).choices


# ---- continuous batching ---------------------------------------------------------------------------------


def test_a_request_joins_a_running_one_and_a_disconnect_frees_its_slot(server, client):
    batcher = server.backend.batcher
    long_stream = client.chat.completions.create(model=MODEL, messages=_user("Tell me a long story."),
                                                 max_tokens=900, temperature=1.0, stream=True,
                                                 extra_body={"ignore_eos": True})
    iterator = iter(long_stream)
    next(iterator), next(iterator)  # the role chunk, then the first tokens: the long request is decoding
    short = client.chat.completions.create(model=MODEL, messages=_user("Say hello."), max_tokens=5, temperature=0)
    assert short.choices[0].finish_reason == "length"
    assert batcher.running == 1, "the long request must still be running when the short one is done"
    tokens_before = batcher.completion_tokens
    long_stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 10
    while batcher.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batcher.running == 0 and batcher.waiting == 0
    assert batcher.completion_tokens - tokens_before < 850, "the cancelled request kept decoding"


def test_64_concurrent_clients_get_what_each_gets_alone(server):
    prompts = [_user(f"Question {i}: what is {i} plus {2 * i}?") for i in range(64)]
    expected = [_alone(server, messages, 16) for messages in prompts]

    steps_before = server.backend.batcher.steps
    got = _ask_all(server.url, prompts)
    assert got == expected
    assert server.backend.batcher.steps - steps_before < 64 * 16 / 4, "the requests were not batched together"


def test_metrics_count_requests_tokens_and_timings(server, client):
    client.chat.completions.create(model=MODEL, messages=_user("Say hello."), max_tokens=4, temperature=0)
    code, text = _get(server.url + "/metrics")
    assert code == 200
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['posttrain_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert values["posttrain_completion_tokens_total"] >= 4
    assert values["posttrain_prompt_tokens_total"] > 0
    assert values["posttrain_time_to_first_token_seconds_count"] >= 1
    assert values["posttrain_request_latency_seconds_count"] >= 1
    assert "posttrain_queue_depth" in values


def test_an_api_key_is_required_when_set(server):
    engine = server.backend.batcher.engine
    with start_server(HFBackend(ContinuousBatcher(engine)), MODEL, api_key="s3cret") as keyed:
        code, body = _get(keyed.url + "/v1/models")
        assert code == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert _post(keyed.url + "/v1/chat/completions", {"model": MODEL, "messages": _user("hi")})[0] == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=keyed.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(model=MODEL, messages=_user("Say hello."), max_tokens=2).choices
        assert _get(keyed.url + "/health")[0] == 200  # probes need no key


def test_the_http_side_in_a_process_of_its_own_serves_the_same(server):
    """`posttrain serve`'s default layout: uvicorn in a child process, the engine loop here, joined by pipes."""
    engine = server.backend.batcher.engine
    batcher = ContinuousBatcher(engine)
    with start_server(HFBackend(batcher), MODEL, http_process=True) as split:
        client = openai.OpenAI(base_url=split.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        prompts = [_user(f"Question {i}: what is {i} plus {2 * i}?") for i in range(8)] + [_user("Say hello.")]
        assert _ask_all(split.url, prompts) == [_alone(server, messages, 16) for messages in prompts]
        with client.chat.completions.stream(model=MODEL, messages=_user(QUESTION), tools=[CALCULATOR],
                                            temperature=0, max_tokens=60) as stream:
            final = stream.get_final_completion()
        assert json.loads(final.choices[0].message.tool_calls[0].function.arguments) == {"expression": "2+3"}
        with pytest.raises(openai.BadRequestError, match="context"):
            client.chat.completions.create(model=MODEL, messages=_user("hi"), max_tokens=100_000)
        long_stream = client.chat.completions.create(model=MODEL, messages=_user("Tell me a long story."),
                                                     max_tokens=900, temperature=1.0, stream=True,
                                                     extra_body={"ignore_eos": True})
        iterator = iter(long_stream)
        next(iterator), next(iterator)
        tokens_before = batcher.completion_tokens
        long_stream.close()  # the client goes away: the engine (in this process) drops the row
        deadline = time.monotonic() + 10
        while batcher.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batcher.running == 0 and batcher.completion_tokens - tokens_before < 850
        code, text = _get(split.url + "/metrics")
        assert code == 200 and "posttrain_time_to_first_token_seconds_count" in text



def test_a_backend_without_a_batcher_serves_on_a_thread_the_same(server):
    """`VLLMBackend` (what speculative decoding serves through; the HF engine stands in for vLLM): asked for the
    process layout it has no batcher for, it runs on a thread; its whole-call results reach the streams and
    replies as the batcher's steps do, and a prompt past the context is the same 400."""
    from posttrain.serve import VLLMBackend

    engine = server.backend.batcher.engine
    with start_server(VLLMBackend(engine, engine.max_length, engine.vocab_size), MODEL, http_process=True) as other:
        client = openai.OpenAI(base_url=other.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        prompts = [_user(f"Question {i}: what is {i} plus {2 * i}?") for i in range(4)] + [_user("Say hello.")]
        assert _ask_all(other.url, prompts) == [_alone(server, messages, 16) for messages in prompts]
        with pytest.raises(openai.BadRequestError, match="context"):
            client.chat.completions.create(model=MODEL, messages=_user("hi"), max_tokens=100_000)


# ---- the command ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_serve_command_requires_its_api_key(checkpoint):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(
        [sys.executable, "-m", "posttrain", "serve", str(checkpoint), "--port", str(port), "--api-key", "s3cret",
         "--model-name", MODEL, "--precision", "fp32", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        banner = process.stdout.readline()
        assert f"127.0.0.1:{port}" in banner, banner
        url = f"http://127.0.0.1:{port}"
        code, body = _get(url + "/v1/models")
        assert code == 401 and json.loads(body)["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        reply = keyed.chat.completions.create(model=MODEL, messages=_user("Say hello."), temperature=0, max_tokens=8)
        assert reply.choices[0].message.content.startswith("Hello")
        assert _get(url + "/health")[0] == 200  # probes need no key
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_stream_wake_ups_are_coalesced_to_the_interval():
    from posttrain.serve.backends import _Signals

    async def scenario() -> tuple[bool, bool, bool]:
        signals = _Signals(interval_s=0.3)
        request = StreamRequest([1, 2], SamplingParams(max_new_tokens=4))
        event = signals.open(request)
        await asyncio.to_thread(signals.notify, [request])  # the first step: woken at once
        await asyncio.sleep(0.05)
        first = event.is_set()
        event.clear()
        for _ in range(3):  # three more steps within the interval: one wake-up, when the interval is over
            await asyncio.to_thread(signals.notify, [request])
        await asyncio.sleep(0.1)
        held = not event.is_set()
        await asyncio.sleep(0.4)
        return first, held, event.is_set()

    assert asyncio.run(scenario()) == (True, True, True)


def test_served_engine_leaves_one_core_to_the_http_side_on_a_cpu():
    import torch

    from posttrain.serve import serving_threads
    from posttrain.serve.remote import event_loop

    assert serving_threads("cpu") == max(1, torch.get_num_threads() - 1)
    assert serving_threads("cuda") is None  # a GPU engine keeps torch's default
    loop = event_loop()  # the HTTP process's loop: uvloop's where the serve extra installed it
    try:
        assert loop.run_until_complete(asyncio.sleep(0, result="ran")) == "ran"
    finally:
        loop.close()


def test_a_vision_language_model_that_loads_as_a_causal_lm_is_served_text_only_and_ends_before_its_image_token(
        tiny_tokenizer, tmp_path):
    """Gemma 3 (as Llama 4, Mllama ...) loads through AutoModelForCausalLM, so `posttrain serve` serves it, on text
    chats (image parts are a 400). Its replies end before its image token, as the engine's own do: the batcher's
    stop rule holds the model's placeholder ids (the cut itself: test_rollout_continuous). A LLaVA-style model has
    no causal-LM class: a one-line error naming it, not transformers' traceback."""
    import torch
    from test_models_vision import _gemma3, _llava

    from posttrain.models import ModelError

    torch.manual_seed(0)
    model, processor, _ = _gemma3(tiny_tokenizer)
    model.save_pretrained(tmp_path / "gemma3")
    processor.save_pretrained(tmp_path / "gemma3")
    backend = make_backend(tmp_path / "gemma3", precision="fp32", num_threads=1)
    engine = backend.batcher.engine
    assert engine.placeholder_ids == {model.config.image_token_id}
    request = StreamRequest([5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0))
    assert backend.batcher._rows_for(request, 0)[0].rule.placeholder_ids == engine.placeholder_ids
    with start_server(backend, "tiny-gemma3") as handle:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="tiny-gemma3", messages=_user("What is 2 + 2?"), max_tokens=4)
        assert reply.choices[0].finish_reason in {"stop", "length"}
        with pytest.raises(openai.BadRequestError, match="image"):
            client.chat.completions.create(model="tiny-gemma3", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])

    llava, llava_processor, _ = _llava(tiny_tokenizer)
    llava.save_pretrained(tmp_path / "llava")
    llava_processor.save_pretrained(tmp_path / "llava")
    with pytest.raises(ModelError, match="vision-language model that loads only with its processor"):
        make_backend(tmp_path / "llava", precision="fp32", num_threads=1)
