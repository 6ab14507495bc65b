"""The FastAPI app: OpenAI's chat and text completion endpoints over a `Backend`, plus health and metrics.

    GET  /v1/models            the one model served
    POST /v1/chat/completions  messages, sampling, n, stop, seed, stream (SSE), logprobs, tools / tool_choice
    POST /v1/completions       text (or token-id) prompts
    GET  /health               200 {"status": "ok"} while the server is up
    GET  /metrics              Prometheus text: requests, tokens in/out, queue depth, TTFT, latency

Every refused request is OpenAI's error JSON (``{"error": {"message", "type", "param", "code"}}``) with a 4xx:
400 for a malformed body or a value out of range (the message names the field), 404 for an unknown model or
path, 401 without the API key when the server has one (``Authorization: Bearer KEY``; /health and /metrics stay
open for probes and scrapers). Streams coalesce: a chunk carries every token sampled since the last one the
client took, so a slow reader gets fewer, larger chunks instead of slowing the batch. ``ignore_eos`` (as in
vLLM, via the client's ``extra_body``) samples past the end-of-sequence token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from posttrain.rollout import SequenceEvent, StreamRequest
from posttrain.serve.backends import Backend
from posttrain.serve.errors import APIError
from posttrain.serve.metrics import Metrics
from posttrain.serve.prompting import ChatPrompt, TextStream, ToolCallDeltas, merge_call_deltas, render_chat
from posttrain.serve.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from posttrain.types import Completion, SamplingParams

_OPEN_PATHS = ("/health", "/metrics")
_ENDPOINTS = frozenset({"/v1/models", "/v1/chat/completions", "/v1/completions", *_OPEN_PATHS})


def create_app(backend: Backend, model_name: str, *, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="posttrain", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics(lambda: backend.waiting, lambda: backend.running)
    app.state.metrics = metrics
    created = int(time.time())
    tokenizer = backend.tokenizer

    app.add_middleware(_Guard, api_key=api_key, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return _error(error)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return _error(_validation_error(error))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error(APIError(error.status_code, f"{request.method} {request.url.path}: {error.detail}", type=kind))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "waiting": backend.waiting, "running": backend.running}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(model_name, created)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        _check_model(name, model_name)
        return _model_card(model_name, created)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Any:
        _check_model(body.model, model_name)
        prompt = render_chat(tokenizer, body)
        limit = _token_limit(backend, prompt.token_ids, body.token_limit())
        top = (body.top_logprobs or 0) if body.logprobs else 0
        request = StreamRequest(prompt.token_ids, _sampling(body, limit), top_logprobs=top,
                                request_id=f"chatcmpl-{uuid.uuid4().hex}", ignore_eos=body.ignore_eos)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_chat_stream(backend, metrics, request, prompt, body, model_name, include_usage),
                                     media_type="text/event-stream")
        completions, tops = await _collect(backend, request, http)
        return _chat_response(request, prompt, body, completions, tops, tokenizer, model_name, metrics)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Any:
        _check_model(body.model, model_name)
        prompts = [p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=False)
                   for p in body.prompts()]
        if body.stream and len(prompts) > 1:
            raise APIError(400, "stream with several prompts is not supported; send one request per prompt",
                           param="prompt")
        requests = []
        for ids in prompts:
            limit = _token_limit(backend, ids, body.max_tokens)
            requests.append(StreamRequest(ids, _sampling(body, limit), top_logprobs=body.logprobs or 0,
                                          request_id=f"cmpl-{uuid.uuid4().hex}", ignore_eos=body.ignore_eos))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_text_stream(backend, metrics, requests[0], body, model_name, include_usage),
                                     media_type="text/event-stream")
        choices, prompt_tokens, completion_tokens = [], 0, 0
        # Each prompt is its own request; they join the batch together.
        collected = await asyncio.gather(*(_collect(backend, request, http) for request in requests))
        for number, (request, (done, tops)) in enumerate(zip(requests, collected)):
            prompt_tokens += len(request.prompt_token_ids)
            for index, completion in enumerate(done):
                completion_tokens += len(completion.token_ids)
                choices.append({
                    "index": number * body.n + index, "text": completion.text,
                    "finish_reason": completion.finish_reason,
                    "logprobs": _text_logprobs(completion, tops[index], tokenizer) if body.logprobs is not None
                    else None,
                })
            _observe(metrics, request, len(request.prompt_token_ids), sum(len(c.token_ids) for c in done))
        return {"id": requests[0].request_id, "object": "text_completion", "created": int(time.time()),
                "model": model_name, "choices": choices,
                "usage": _usage(prompt_tokens, completion_tokens)}

    return app


class _Guard:
    """The API key check and the request counter, as plain ASGI (no per-chunk cost on streams)."""

    def __init__(self, app: Any, api_key: str | None, metrics: Metrics):
        self.app, self.metrics = app, metrics
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.expected is not None and path not in _OPEN_PATHS:
            if dict(scope["headers"]).get(b"authorization") != self.expected:
                self.metrics.request(path if path in _ENDPOINTS else "other", 401)
                response = _error(APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                                           type="authentication_error", code="invalid_api_key"))
                await response(scope, receive, send)
                return

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                self.metrics.request(path if path in _ENDPOINTS else "other", status)  # bounded label values
            await send(message)

        await self.app(scope, receive, counted)


# ---- request checks ---------------------------------------------------------------------------------------


def _check_model(name: str, model_name: str) -> None:
    if name != model_name:
        raise APIError(404, f"the model '{name}' does not exist; this server serves '{model_name}'",
                       type="not_found_error", param="model", code="model_not_found")


def _token_limit(backend: Backend, prompt: list[int], asked: int | None) -> int:
    """The completion's token budget: what was asked, or the room left in the context."""
    context = backend.max_length
    if context is not None and len(prompt) >= context:
        raise APIError(400, f"this model's maximum context length is {context} tokens, and the prompt has "
                       f"{len(prompt)}", param="messages", code="context_length_exceeded")
    if asked is not None and context is not None and len(prompt) + asked > context:
        raise APIError(400, f"this model's maximum context length is {context} tokens; the prompt has "
                       f"{len(prompt)} and max_tokens asks for {asked} more", param="max_tokens",
                       code="context_length_exceeded")
    limit = asked if asked is not None else (context - len(prompt) if context is not None else 256)
    backend.check(prompt, limit)
    return limit


def _sampling(body: _Sampling, limit: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=limit, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, n=body.n, stop=list(body.stop or []), seed=body.seed,
        include_stop_in_output=False,  # OpenAI's text ends before the stop sequence
    )


def _validation_error(error: RequestValidationError) -> APIError:
    problems, param = [], None
    for item in error.errors():
        location = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
        if item.get("type") == "json_invalid":
            return APIError(400, f"the request body is not valid JSON: {item.get('msg')}")
        if item.get("type") == "lone_surrogate":
            location = item["ctx"]["path"]
        if item.get("type") == "extra_forbidden":
            problems.append(f"{location}: unknown or unsupported parameter")
        else:
            problems.append(f"{location or 'body'}: {item.get('msg')}")
        param = param or location or None
    return APIError(400, "invalid request: " + "; ".join(problems), param=param)


def _error(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "posttrain"}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _observe(metrics: Metrics, request: StreamRequest, prompt_tokens: int, completion_tokens: int) -> None:
    metrics.tokens(prompt_tokens, completion_tokens)
    ttft = None if request.first_token_s is None else request.first_token_s - request.submitted_s
    metrics.timings(ttft, time.monotonic() - request.submitted_s)


# ---- collecting and shaping results -----------------------------------------------------------------------


async def _collect(backend: Backend, request: StreamRequest, http: Request
                   ) -> tuple[list[Completion], list[list[list[tuple[int, float]]]]]:
    tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(request.sampling.n)]
    async for batch in backend.events(request, http.is_disconnected):
        for event in batch:
            tops[event.index].append(event.top_logprobs)
    if not request.done or request.cancelled:
        raise APIError(499, "the client closed the request")
    return [c for c in request.completions if c is not None], tops


def _token_entry(tokenizer: Any, token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := tokenizer.decode([i])), "logprob": lp, "bytes": list(t.encode())}
                             for i, lp in top]}


def _chat_logprobs(completion: Completion, tops: list[list[tuple[int, float]]], tokenizer: Any) -> dict[str, Any]:
    return {"content": [_token_entry(tokenizer, token, logprob, tops[i] if i < len(tops) else [])
                        for i, (token, logprob) in enumerate(zip(completion.token_ids, completion.logprobs))]}


def _text_logprobs(completion: Completion, tops: list[list[tuple[int, float]]], tokenizer: Any) -> dict[str, Any]:
    tokens = [tokenizer.decode([t]) for t in completion.token_ids]
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {"tokens": tokens, "token_logprobs": list(completion.logprobs),
            "top_logprobs": [{tokenizer.decode([i]): lp for i, lp in (tops[n] if n < len(tops) else [])}
                             for n in range(len(tokens))],
            "text_offset": offsets}


def _chat_response(request: StreamRequest, prompt: ChatPrompt, body: ChatCompletionRequest,
                   completions: list[Completion], tops: list[list[list[tuple[int, float]]]], tokenizer: Any,
                   model_name: str, metrics: Metrics) -> dict[str, Any]:
    choices = []
    for index, completion in enumerate(completions):
        stream = TextStream(tokenizer, [], prompt.parse_tools, prompt.forced_prefix)
        content, calls = stream.finish(completion.text)
        message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
        if calls:
            message["tool_calls"] = calls
        choices.append({"index": index, "message": message,
                        "finish_reason": "tool_calls" if calls else completion.finish_reason,
                        "logprobs": _chat_logprobs(completion, tops[index], tokenizer) if body.logprobs else None})
    completion_tokens = sum(len(c.token_ids) for c in completions)
    _observe(metrics, request, len(prompt.token_ids), completion_tokens)
    return {"id": request.request_id, "object": "chat.completion", "created": int(time.time()), "model": model_name,
            "choices": choices, "usage": _usage(len(prompt.token_ids), completion_tokens),
            "system_fingerprint": f"posttrain-v{completions[0].policy_version if completions else 0}"}


# ---- streams ----------------------------------------------------------------------------------------------


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _kept(event: SequenceEvent, seen: int) -> bool:
    """Whether the event's token is part of the finished completion (a cut stop token is not)."""
    return event.completion is None or seen <= len(event.completion.token_ids)


async def _chat_stream(backend: Backend, metrics: Metrics, request: StreamRequest, prompt: ChatPrompt,
                       body: ChatCompletionRequest, model_name: str, include_usage: bool) -> AsyncIterator[str]:
    tokenizer, n = backend.tokenizer, request.sampling.n
    head = {"id": request.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model_name}
    streams = [TextStream(tokenizer, request.sampling.stop, prompt.parse_tools, prompt.forced_prefix)
               for _ in range(n)]
    tool_calls = [ToolCallDeltas() for _ in range(n)]

    def choices_of(batch: list[SequenceEvent]) -> tuple[list[dict[str, Any]], int]:
        deltas: dict[int, dict[str, Any]] = {}
        calls: dict[int, list[dict[str, Any]]] = {}
        finished = 0
        grown: set[int] = set()  # choices whose text grew: their tool-call deltas are taken once per chunk

        def take_call_deltas(index: int) -> None:
            calls.setdefault(index, []).extend(tool_calls[index].update(prompt.forced_prefix + streams[index].text))

        for event in batch:
            stream = streams[event.index]
            choice = deltas.setdefault(event.index, {"index": event.index, "delta": {}, "logprobs": None,
                                                     "finish_reason": None})
            text = stream.add(event.token_id) if event.token_id >= 0 else ""
            if prompt.parse_tools and event.token_id >= 0:
                grown.add(event.index)
            if body.logprobs and event.token_id >= 0 and _kept(event, len(stream.tokens)):
                entry = _token_entry(tokenizer, event.token_id, event.logprob, event.top_logprobs)
                choice["logprobs"] = {"content": (choice["logprobs"] or {"content": []})["content"] + [entry]}
            if event.completion is not None:
                last, called = stream.finish(event.completion.text)
                text += last
                if prompt.parse_tools:
                    if event.index in grown:
                        grown.discard(event.index)
                        take_call_deltas(event.index)
                    calls.setdefault(event.index, []).extend(
                        tool_calls[event.index].finish(prompt.forced_prefix + event.completion.text))
                choice["finish_reason"] = "tool_calls" if called else event.completion.finish_reason
                finished += len(event.completion.token_ids)
            if text:
                choice["delta"]["content"] = choice["delta"].get("content", "") + text
        for index in grown:
            take_call_deltas(index)
        for index, sent in calls.items():
            if sent:
                deltas[index]["delta"]["tool_calls"] = merge_call_deltas(sent)
        return [c for c in deltas.values() if c["delta"] or c["finish_reason"] or c["logprobs"]], finished

    yield "".join(_sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]}) for i in range(n))
    async with contextlib.aclosing(_event_stream(backend, metrics, request, head, include_usage, choices_of)) as parts:
        async for part in parts:
            yield part


async def _text_stream(backend: Backend, metrics: Metrics, request: StreamRequest, body: CompletionRequest,
                       model_name: str, include_usage: bool) -> AsyncIterator[str]:
    tokenizer, n = backend.tokenizer, request.sampling.n
    head = {"id": request.request_id, "object": "text_completion", "created": int(time.time()), "model": model_name}
    streams = [TextStream(tokenizer, request.sampling.stop, False) for _ in range(n)]

    def choices_of(batch: list[SequenceEvent]) -> tuple[list[dict[str, Any]], int]:
        choices: dict[int, dict[str, Any]] = {}
        finished = 0
        for event in batch:
            stream = streams[event.index]
            choice = choices.setdefault(event.index, {"index": event.index, "text": "", "logprobs": None,
                                                      "finish_reason": None})
            choice["text"] += stream.add(event.token_id) if event.token_id >= 0 else ""
            if event.completion is not None:
                choice["text"] += stream.finish(event.completion.text)[0]
                choice["finish_reason"] = event.completion.finish_reason
                finished += len(event.completion.token_ids)
        return [c for c in choices.values() if c["text"] or c["finish_reason"]], finished

    async with contextlib.aclosing(_event_stream(backend, metrics, request, head, include_usage, choices_of)) as parts:
        async for part in parts:
            yield part


async def _event_stream(backend: Backend, metrics: Metrics, request: StreamRequest, head: dict[str, Any],
                        include_usage: bool,
                        choices_of: Callable[[list[SequenceEvent]], tuple[list[dict[str, Any]], int]],
                        ) -> AsyncIterator[str]:
    """The SSE body of one streamed request, chat or text: `choices_of(batch)` turns a batch of events into the
    choices to send and the completion tokens it finished. Usage, ``[DONE]``, an error chunk, freeing the slot
    when the client goes away (the callers close this generator with theirs) and the metrics are the same."""
    completed = 0
    try:
        async for batch in backend.events(request):
            chunks, finished = choices_of(batch)
            completed += finished
            if chunks:
                yield "".join(_sse({**head, "choices": [c]}) for c in chunks)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(len(request.prompt_token_ids), completed)})
        yield "data: [DONE]\n\n"
    except APIError as error:
        yield _sse(error.body())
    finally:
        if not request.done:
            backend.cancel(request)
        _observe(metrics, request, len(request.prompt_token_ids), completed)
