"""Tokenization through the tokenizer's own chat template, with loss only on assistant tokens.

Works for any Hugging Face chat template, not only the built-in one, by rendering text and never assuming a
format. For each assistant message i the template renders

    before_i = render(messages[:i], add_generation_prompt=True)    # ends where the reply starts
    after_i  = render(messages[:i + 1])                             # ends after the reply's end-of-turn

and the reply's character span is ``[len(before_i), len(after_i))``: it includes whatever the template writes
after the content (the end-of-turn / eos token), so the model learns to stop. The whole conversation is then
tokenized once with offsets (no special tokens added: the template has them) and a token carries loss when
it starts inside a span. Tool results, system and user text never carry loss; assistant turns with tool
calls do.

This needs a *prefix-stable* template: before_i a prefix of after_i, and after_i a prefix of the whole
rendering. Templates that rewrite earlier turns (e.g. dropping old reasoning) are not, and are refused with
a `DataError` rather than trained with misplaced masks.

``reasoning="include"`` writes ``metadata.reasoning_trace`` into the last assistant turn as
``<think>{trace}</think>`` before its content; ``"drop"`` leaves it out. Tools listed in
``metadata.extras["tools"]`` are passed to the template's `tools` argument.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from posttrain.data.schema import DataError, SampleMetadata, SFTSample
from posttrain.types import Message

Reasoning = Literal["include", "drop"]
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class TokenizedSample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is trained (assistant text and its end-of-turn)
    metadata: SampleMetadata = field(default_factory=SampleMetadata)
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class TokenizeResult:
    samples: list[TokenizedSample]
    truncated: int  # cut to max_length (and kept, since loss tokens were left)
    dropped: int  # no loss token left after truncation

    def report(self) -> dict[str, int]:
        return {
            "truncated": self.truncated,
            "dropped_no_loss_tokens": self.dropped,
            "tokens": sum(len(s) for s in self.samples),
            "loss_tokens": sum(s.num_loss_tokens for s in self.samples),
        }


def tokenize_sample(
    sample: SFTSample, tokenizer: Any, max_length: int, reasoning: Reasoning = "include"
) -> TokenizedSample:
    """One sample; may return a sample with no loss token (`tokenize_samples` drops and counts those)."""
    return tokenize_samples([sample], tokenizer, max_length, reasoning, keep_empty=True).samples[0]


def tokenize_samples(
    samples: Sequence[SFTSample],
    tokenizer: Any,
    max_length: int,
    reasoning: Reasoning = "include",
    *,
    keep_empty: bool = False,
) -> TokenizeResult:
    """Tokenize many samples: render each (two template calls per assistant turn at most), then one batched,
    parallel tokenizer call with offsets. Samples longer than `max_length` are cut and counted; those left
    with no loss token are dropped and counted (unless `keep_empty`)."""
    _check_tokenizer(tokenizer)
    if reasoning not in ("include", "drop"):
        raise DataError(f"reasoning: expected 'include' or 'drop', got {reasoning!r}")
    renderer = _Renderer(tokenizer)
    rendered = [_render_sample(sample, renderer, reasoning, index) for index, sample in enumerate(samples)]
    encodings = _encode([text for text, _ in rendered], tokenizer)
    out: list[TokenizedSample] = []
    truncated = dropped = 0
    for sample, (text, spans), (ids, offsets) in zip(samples, rendered, encodings):
        mask = _mask_from_offsets(offsets, spans)
        cut = len(ids) > max_length
        if cut:
            ids, mask = ids[:max_length], mask[:max_length]
            truncated += 1
        if not any(mask) and not keep_empty:
            dropped += 1
            continue
        out.append(TokenizedSample(input_ids=ids, loss_mask=mask, metadata=sample.metadata, truncated=cut))
    return TokenizeResult(samples=out, truncated=truncated, dropped=dropped)


def conversation_for_training(sample: SFTSample, reasoning: Reasoning) -> list[Message]:
    """The messages as the template will see them: the reasoning trace put into (or left out of) the last reply."""
    messages = list(sample.messages)
    trace = sample.metadata.reasoning_trace
    if reasoning == "include" and trace:
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        reply = dict(messages[last])
        reply["content"] = f"{THINK_OPEN}{trace}{THINK_CLOSE}{reply.get('content') or ''}"
        messages[last] = reply
    return messages


def assistant_spans(
    messages: Sequence[Message], tokenizer: Any, tools: list[dict[str, Any]] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """Render `messages` and return the text with the character span of every assistant reply."""
    return _Renderer(tokenizer).spans(messages, tools)


class _Renderer:
    """Renders prefixes through the chat template, remembering each rendering for the batch.

    Several samples often share a prompt (many answers to one question, a common system prompt and first
    turns): their ``before`` renderings are then looked up instead of re-rendered. The last reply's
    ``after`` is the whole conversation, rendered once.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.cache: dict[tuple, str] = {}

    def spans(self, messages: Sequence[Message], tools: Any) -> tuple[str, list[tuple[int, int]]]:
        tools_key = json.dumps(tools, sort_keys=True) if tools else None
        keys = [_message_key(m) for m in messages]

        def render(end: int, generation_prompt: bool) -> str:
            return self.render(messages[:end], (generation_prompt, tools_key, *keys[:end]), generation_prompt, tools)

        full = render(len(messages), False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = render(i, True)
            after = full if i == len(messages) - 1 else render(i + 1, False)
            if not after.startswith(before):
                raise DataError(_unstable(f"messages[:{i}] with the generation prompt", f"messages[:{i + 1}]"))
            if not full.startswith(after):
                raise DataError(_unstable(f"messages[:{i + 1}]", "the whole conversation"))
            spans.append((len(before), len(after)))
        return full, spans

    def render(self, messages: Sequence[Message], key: tuple, generation_prompt: bool, tools: Any) -> str:
        text = self.cache.get(key)
        if text is None:
            text = self.cache[key] = _render(self.tokenizer, messages, generation_prompt, tools)
        return text


def _message_key(message: Message) -> tuple:
    calls = message.get("tool_calls")
    return (
        message["role"],
        message.get("content"),
        json.dumps(calls, sort_keys=True) if calls else None,
        message.get("name"),
        message.get("tool_call_id"),
    )


def _unstable(part: str, whole: str) -> str:
    return (
        f"the chat template is not prefix-stable: rendering {part} is not a prefix of rendering {whole}, so "
        "assistant tokens cannot be located (templates that rewrite earlier turns, e.g. strip old reasoning, do "
        "this); set model.chat_template to a template that renders every turn the same way"
    )


def _render_sample(
    sample: SFTSample, renderer: _Renderer, reasoning: Reasoning, index: int
) -> tuple[str, list[tuple[int, int]]]:
    messages = conversation_for_training(sample, reasoning)
    try:
        return renderer.spans(messages, sample.metadata.extras.get("tools"))
    except DataError as error:
        where = sample.metadata.origin or f"sample {index} (source {sample.metadata.source})"
        raise DataError(f"{where}: {error}") from None


def _render(tokenizer: Any, messages: Sequence[Message], generation_prompt: bool, tools: Any) -> str:
    try:
        return tokenizer.apply_chat_template(
            list(messages), tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )
    except Exception as error:  # jinja raises TemplateError, templates raise their own exceptions
        raise DataError(f"the chat template failed on {len(messages)} messages: {error}") from error


def _encode(texts: list[str], tokenizer: Any) -> list[tuple[list[int], list[tuple[int, int]]]]:
    if not texts:
        return []
    try:
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as error:
        raise DataError(
            "the tokenizer cannot return character offsets (a slow, Python tokenizer); use its fast version"
        ) from error
    return list(zip(encoded["input_ids"], encoded["offset_mapping"]))


def _mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for tokens starting inside a span. Offsets and spans both increase, so one walk suffices."""
    mask = [0] * len(offsets)
    span_index = 0
    for position, (start, _end) in enumerate(offsets):
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        if span_index == len(spans):
            break
        if start >= spans[span_index][0]:
            mask[position] = 1
    return mask


def _check_tokenizer(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "the tokenizer has no chat template; set model.chat_template in the recipe (a Jinja template or a "
            "file holding one)"
        )
