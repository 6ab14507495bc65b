"""The request bodies of the OpenAI API subset the server speaks, as strict pydantic models.

Only what the server can honour is accepted: a parameter it cannot honour (``logit_bias``, a nonzero
``presence_penalty``, image parts ...) is a 400 that names it, never silently ignored. A few fields clients
send by habit and that change nothing here (``user``, ``metadata``, ``store``, ``parallel_tool_calls``,
``service_tier``) are accepted and ignored. Everything else unknown is a 400 naming the field.

Types are strict, as OpenAI's own API is: ``"max_tokens": "5"``, ``"stream": "yes"``, ``"n": 2.0`` or
``"logprobs": 1`` are 400s naming the field, not coerced into a request the client did not write (an integer
where a number is asked, ``"temperature": 1``, is a number).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from posttrain.envs import lone_surrogate

IGNORED_FIELDS = ("user", "metadata", "store", "parallel_tool_calls", "service_tier")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; a dict is accepted too


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a '{self.role}' message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionSpec(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpecIn(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False  # vLLM's extension: sample past the end-of-sequence token
    # Accepted and ignored (see the module docstring).
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        where = lone_surrogate(data)
        if where is not None:  # JSON's \ud800 escapes decode to text no tokenizer (or UTF-8) can take
            raise PydanticCustomError("lone_surrogate", "not valid Unicode text (a lone surrogate, such as "
                                      "the JSON escape \\ud800 on its own)", {"path": where})
        return data

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported by this server (only 0)")
        return value


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolSpecIn] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice other than 'none'/'auto' needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [tool.function.name for tool in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names '{self.tool_choice.function.name}', not one of the tools {names}")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# One /v1/completions request's sequences (prompts x n): a list of 100,000 prompts was taken whole, each
# tokenized and queued at once, with no bound but the server's memory
MAX_SEQUENCES_PER_REQUEST = 256


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported by this server")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of not in (None, 1, self.n):
            raise ValueError("best_of is not supported by this server (leave it unset)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is empty")
        prompts = len(self.prompts())
        if prompts * self.n > MAX_SEQUENCES_PER_REQUEST:
            raise ValueError(f"{prompts} prompts x n={self.n} ask for {prompts * self.n} sequences; at most "
                             f"{MAX_SEQUENCES_PER_REQUEST} per request: send the prompts in several requests")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts: texts, or token-id lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]
