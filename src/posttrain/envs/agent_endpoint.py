"""The per-episode OpenAI endpoint of a black-box agent: each chat completion is sampled from the policy and
recorded token in, token out.

    endpoint = RecordingEndpoint(policy, tokenizer, sampling, limits=EndpointLimits(max_calls=8))
    # POST /v1/chat/completions (non-streamed, or streamed as one chunk), GET /v1/models

How calls are joined into one trajectory (the recorded ids always win over a re-rendering):

* calls are served one at a time, in arrival order (an episode is one conversation);
* a call **continues** the current segment when its ``tools`` equal the segment's and its messages begin with
  the segment's whole transcript -- every earlier message equal, and each earlier assistant turn equal (content,
  and tool calls by name and arguments; call ids are ignored) to the reply this endpoint sent. The prompt the
  policy then sees is the segment's token ids so far (the earlier completions *as sampled*) plus the chat
  template's delta for the new messages (`TranscriptTokens.add_observation`, ``loss_mask`` 0). So an agent that
  re-sends an assistant turn it got (with JSON re-spaced tool arguments, say) never has that turn re-tokenized;
* any other call (the history edited, truncated or summarised, other tools, a template that is not
  prefix-stable) starts a **new segment**, its prompt rendered afresh from the messages.

Each segment is one causal token sequence; `segments` holds them all. The sampling is the recipe's (the agent's
``temperature``, ``top_p``, ``seed`` ... are ignored and noted in `ignored_params`), because the trainer's
behaviour logprobs must come from the distribution the recipe configures; the agent's ``max_tokens`` (or
``max_completion_tokens``) is honoured as a cap. ``n`` > 1 and ``tool_choice`` other than ``auto``/``none`` are
refused with a 400 naming the field. Past a limit (calls, completion tokens, context) the call is refused with a
400 whose ``code`` is ``posttrain_limit`` (not retried by the ``openai`` client) and `limit_hit` says which.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from posttrain.envs.agent_http import error_body, json_body
from posttrain.envs.base import EnvError
from posttrain.envs.parsing import get_parser, lone_surrogate
from posttrain.envs.policy import turn_sampling
from posttrain.envs.tokens import TranscriptTokens, strip_eos
from posttrain.types import Completion, GenerationRequest, Message, SamplingParams

MODEL_NAME = "policy"
_IGNORED = ("temperature", "top_p", "seed", "frequency_penalty", "presence_penalty", "logit_bias", "stop",
            "top_logprobs", "logprobs", "user", "metadata", "store", "parallel_tool_calls", "service_tier",
            "stream_options", "response_format", "reasoning_effort")
_KNOWN = {"model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "n", "stream",
          *_IGNORED}


@dataclass(frozen=True)
class EndpointLimits:
    max_calls: int = 16  # chat completions per episode
    max_completion_tokens: int = 4096  # sampled tokens per episode, all calls together
    max_context_tokens: int | None = None  # prompt + completion of one call


@dataclass
class CallRecord:
    """One served call: where its tokens are in which segment."""

    segment: int
    prompt_token_ids: list[int]
    completion: Completion
    continued: bool  # True: the prompt extended the segment; False: it opened the segment


@dataclass
class _Refusal(Exception):
    status: int
    message: str
    code: str | None = None


@dataclass
class RecordingEndpoint:
    policy: Any  # async: await policy.generate(request, sampling) -> list[Completion]
    tokenizer: Any
    sampling: SamplingParams
    limits: EndpointLimits = EndpointLimits()
    api_key: str = field(default_factory=lambda: uuid.uuid4().hex)
    parser: Any = None
    template_kwargs: dict[str, Any] | None = None
    segments: list[TranscriptTokens] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    completion_tokens: int = 0
    limit_hit: str | None = None
    engine_error: str | None = None
    ignored_params: set[str] = field(default_factory=set)
    refused_calls: int = 0
    last_answer_at: float | None = None  # time.monotonic() of the last completion served (for diagnostics)

    def __post_init__(self) -> None:
        self._parser = get_parser(self.parser)
        self._lock = asyncio.Lock()
        self._created = int(time.time())

    # ---- HTTP ------------------------------------------------------------------------------------

    async def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
        given = headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            return error_body(401, "missing or wrong API key (use OPENAI_API_KEY as given)", "authentication_error")
        if method == "GET" and path.rstrip("/") == "/v1/models":
            return json_body(200, {"object": "list", "data": [
                {"id": MODEL_NAME, "object": "model", "created": self._created, "owned_by": "posttrain"}]})
        if method != "POST" or path.rstrip("/") != "/v1/chat/completions":
            return error_body(404, f"{method} {path}: this endpoint serves POST /v1/chat/completions and "
                                   "GET /v1/models", "not_found_error")
        try:
            request = json.loads(body or b"null")
            if not isinstance(request, dict):
                raise _Refusal(400, "the body must be a JSON object")
            where = lone_surrogate(request)
            if where is not None:  # a JSON escape such as \ud800 on its own: text no tokenizer can encode
                raise _Refusal(400, f"{where}: not valid Unicode text (a lone surrogate)")
            response = await self.chat(request)
        except (json.JSONDecodeError, RecursionError) as error:
            return error_body(400, f"the body is not JSON ({type(error).__name__}: {error})")
        except _Refusal as refusal:
            self.refused_calls += 1
            return error_body(refusal.status, refusal.message, code=refusal.code)
        if request.get("stream"):
            return 200, "text/event-stream", _as_stream(response)
        return json_body(200, response)

    # ---- one chat completion ---------------------------------------------------------------------

    async def chat(self, request: dict[str, Any]) -> dict[str, Any]:
        messages, tools, cap = _parse_request(request)
        self.ignored_params |= {key for key in _IGNORED if key in request}
        async with self._lock:  # one conversation: calls in arrival order, each joined onto what came before
            if self.engine_error:
                raise _Refusal(500, f"the policy failed earlier in this episode: {self.engine_error}")
            if len(self.calls) >= self.limits.max_calls:
                raise self._limit("calls", f"this episode's limit of {self.limits.max_calls} calls is spent")
            budget = self.limits.max_completion_tokens - self.completion_tokens
            if budget <= 0:
                raise self._limit("tokens", f"this episode's {self.limits.max_completion_tokens} completion "
                                            "tokens are spent")
            try:
                segment, continued = self._join(messages, tools)
            except EnvError as error:  # the template cannot render these messages: the request's fault
                raise _Refusal(400, f"messages: the chat template cannot render them ({error})") from None
            prompt = list(segment.token_ids)
            room = (self.limits.max_context_tokens - len(prompt)) if self.limits.max_context_tokens else budget
            if room <= 0:
                raise self._limit("context", f"the prompt ({len(prompt)} tokens) fills the context")
            max_new = min(self.sampling.max_new_tokens, budget, room, cap or budget)
            sampling = turn_sampling(self.sampling, len(self.calls), max_new)
            try:
                completions = await self.policy.generate(
                    GenerationRequest(prompt_token_ids=prompt, request_id=f"agent:{len(self.calls)}"), sampling)
                completion = completions[0]
            except Exception as error:  # noqa: BLE001 - the system's failure, never the model's
                self.engine_error = f"{type(error).__name__}: {error}"
                raise _Refusal(500, f"the policy failed: {self.engine_error}") from None
            text = strip_eos(completion.text, self.tokenizer)
            content, calls = self._tool_calls(text) if tools else (text, [])
            recorded: Message = {"role": "assistant", "content": content}
            if calls:
                recorded["tool_calls"] = [{"type": "function", "function": {"name": c["function"]["name"],
                                                                            "arguments": c["_arguments"]}}
                                          for c in calls]
            segment.add_policy_turn(completion, recorded)
            if not continued:
                self.segments.append(segment)
            self.calls.append(CallRecord(len(self.segments) - 1, prompt, completion, continued))
            self.completion_tokens += len(completion.token_ids)
            self.last_answer_at = time.monotonic()
        return self._response(content, calls, completion, len(prompt))

    def _join(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> tuple[TranscriptTokens, bool]:
        """The segment this call extends (its observation delta appended), or a new one."""
        if self.segments:
            segment = self.segments[-1]
            recorded = segment.messages
            if (recorded and recorded[-1].get("role") == "assistant" and len(messages) >= len(recorded)
                    and _same_tools(segment.tools, tools)
                    and all(_key(a) == _key(b) for a, b in zip(messages, recorded))):
                try:
                    segment.add_observation([dict(m) for m in messages[len(recorded):]])
                    return segment, True
                except EnvError:  # the template rewrites earlier turns: the call cannot extend the ids
                    pass
        return TranscriptTokens(self.tokenizer, messages, tools, self.template_kwargs), False

    def _tool_calls(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        turn = self._parser.parse(text)
        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "_arguments": call.arguments,
                  "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                 for call in turn.well_formed]
        return (turn.content if calls else text), calls

    def _limit(self, which: str, message: str) -> _Refusal:
        self.limit_hit = self.limit_hit or which
        return _Refusal(400, message, code="posttrain_limit")

    def _response(self, content: str, calls: list[dict[str, Any]], completion: Completion,
                  prompt_tokens: int) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "_arguments"} for call in calls]
        finish = "tool_calls" if calls else ("length" if completion.finish_reason == "length" else "stop")
        used = len(completion.token_ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": MODEL_NAME,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": used, "total_tokens": prompt_tokens + used},
        }


# ---- the request -----------------------------------------------------------------------------------


def _parse_request(request: dict[str, Any]) -> tuple[list[Message], list[dict[str, Any]] | None, int | None]:
    unknown = sorted(set(request) - _KNOWN)
    if unknown:
        raise _Refusal(400, f"unsupported field(s) {unknown}")
    if int(request.get("n") or 1) != 1:
        raise _Refusal(400, "n: one completion per call (an episode is one conversation)")
    if request.get("tool_choice") not in (None, "auto", "none"):
        raise _Refusal(400, "tool_choice: only 'auto' and 'none' (a free-running policy cannot be forced)")
    raw = request.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _Refusal(400, "messages: a non-empty list is required")
    messages = [_message(m, i) for i, m in enumerate(raw)]
    tools = request.get("tools") or None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise _Refusal(400, "tools: a list of tool objects")
    if request.get("tool_choice") == "none":
        tools = None
    cap = request.get("max_completion_tokens") or request.get("max_tokens")
    if cap is not None and (not isinstance(cap, int) or cap < 1):
        raise _Refusal(400, f"max_tokens: a positive integer, got {cap!r}")
    return messages, tools, cap


def _message(raw: Any, index: int) -> Message:
    """An OpenAI message as the Hugging Face dict a chat template takes (tool arguments parsed from JSON)."""
    where = f"messages[{index}]"
    if not isinstance(raw, dict) or raw.get("role") not in ("system", "developer", "user", "assistant", "tool"):
        raise _Refusal(400, f"{where}: a message with role system, developer, user, assistant or tool")
    content = raw.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise _Refusal(400, f"{where}.content: only text parts are supported")
        content = "".join(str(p.get("text", "")) for p in content)
    if content is not None and not isinstance(content, str):
        raise _Refusal(400, f"{where}.content: a string or a list of text parts")
    message: Message = {"role": "system" if raw["role"] == "developer" else raw["role"], "content": content or ""}
    calls = []
    for call in raw.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _Refusal(400, f"{where}.tool_calls: each call needs function.name")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (json.JSONDecodeError, RecursionError) as error:
                raise _Refusal(400, f"{where}.tool_calls: arguments are not JSON ({type(error).__name__}: {error})"
                               ) from None
        calls.append({"type": "function", "function": {"name": function["name"], "arguments": arguments}})
    if calls:
        message["tool_calls"] = calls
    for name in ("name", "tool_call_id"):
        if isinstance(raw.get(name), str):
            message[name] = raw[name]
    return message


def _key(message: Message) -> str:
    """What must be equal for a re-sent message to count as the recorded one (call ids left out)."""
    calls = [(c["function"]["name"], c["function"].get("arguments")) for c in message.get("tool_calls") or []]
    return json.dumps([message.get("role"), (message.get("content") or "").strip(), message.get("name"), calls],
                      sort_keys=True, default=str)


def _same_tools(recorded: list[dict[str, Any]] | None, tools: list[dict[str, Any]] | None) -> bool:
    return json.dumps(recorded or None, sort_keys=True) == json.dumps(tools or None, sort_keys=True)


def _as_stream(response: dict[str, Any]) -> bytes:
    """A finished completion as OpenAI's stream: one chunk with the whole message, a finish chunk, [DONE]."""
    choice = response["choices"][0]
    delta = {"role": "assistant", "content": choice["message"]["content"]}
    if choice["message"].get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(choice["message"]["tool_calls"])]
    base = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}
    chunks = [{**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
              {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
               "usage": response["usage"]}]
    return b"".join(f"data: {json.dumps(chunk)}\n\n".encode() for chunk in chunks) + b"data: [DONE]\n\n"
