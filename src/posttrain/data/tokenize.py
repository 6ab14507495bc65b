"""Tokenization through the tokenizer's own chat template, with loss only on assistant tokens.

This module is the one place chats are rendered for training and scoring (`render_chat`, `prompt_ids`): SFT,
DPO, the RL self-test and the forgetting guard's replay go through it. It works for any Hugging Face chat
template by rendering text and never assuming a format. Each assistant message i is located in the
rendering of the conversation up to and including it:

    before_i = render(messages[:i], add_generation_prompt=True)    # ends where the reply starts
    upto_i   = render(messages[:i + 1])                             # ends after the reply's end-of-turn

and the reply's character span in ``upto_i`` is ``[len(before_i), len(upto_i))``: it includes whatever the
template writes after the content (the end-of-turn / eos token), so the model learns to stop — exactly the
text a model prompted with ``before_i`` is trained to produce. Tool results, system and user text never
carry loss; assistant turns with tool calls do.

One conversation is one training sequence when the template is *prefix-stable* (every ``upto_i`` a prefix of
the whole rendering): the spans are marked in the whole rendering, tokenized once with offsets (no special
tokens added: the template has them); a token carries loss when it starts inside a span. Templates that
render a turn differently once later turns follow do not give one sequence holding every turn as the model
produced it: Qwen3 strips the thinking of turns before the last user message, Phi-3 writes eos only when no
generation prompt follows. Then the conversation becomes several sequences: going back from the last turn,
a turn whose ``upto_i`` is a prefix of the current sequence is marked in it, and any other starts a new
sequence, ``upto_i`` itself. Every assistant token is trained exactly once, as the template renders it when
it is the latest turn. Only a template whose ``before_i`` is not a prefix of ``upto_i`` (the reply changes
the prompt before it) is refused, with a `DataError`. `trained_from` restricts all of this to the turns at
and after an index: a preference pair locates only its response, whatever the template does to the prompt.

``reasoning="include"`` writes ``metadata.reasoning_trace`` into the last assistant turn as
``<think>{trace}</think>`` before its content; ``"drop"`` leaves it out. Tools listed in
``metadata.extras["tools"]`` are passed to the template's `tools` argument.

Renderings are text either way, but a template that only pastes contents is not called per sample: each
conversation shape is rendered once with placeholders and filled in (`posttrain.data.skeleton`, which says when
that is exact; any other template or message is rendered by the template itself).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, Sequence

from posttrain.chat import ChatTemplateError, require_prefix
from posttrain.chat import render_chat as _render_chat
from posttrain.data.schema import DataError, RecordError, SampleMetadata, SFTSample, text_of_parts
from posttrain.data.skeleton import Skeletons
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
    sources: list[int] = field(default_factory=list)  # the input sample of each output sequence

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
    """One sample as one sequence; may have no loss token (`tokenize_samples` drops and counts those). A
    conversation the template splits into several sequences is a `DataError` here: use `tokenize_samples`."""
    result = tokenize_samples([sample], tokenizer, max_length, reasoning, keep_empty=True)
    if len(result.samples) != 1:
        raise DataError(f"the chat template renders this conversation as {len(result.samples)} training "
                        "sequences (it rewrites earlier turns); tokenize it with tokenize_samples")
    return result.samples[0]


def tokenize_samples(
    samples: Sequence[SFTSample],
    tokenizer: Any,
    max_length: int,
    reasoning: Reasoning = "include",
    *,
    keep_empty: bool = False,
    trained_from: Sequence[int] | None = None,
) -> TokenizeResult:
    """Tokenize many samples: render each (two renderings per assistant turn at most), then one batched,
    parallel tokenizer call with offsets. A sample gives one sequence, or several for a template that
    rewrites earlier turns (see the module docstring; `TokenizeResult.sources` maps them back). Sequences
    longer than `max_length` are cut and counted; those left with no loss token are dropped and counted
    (unless `keep_empty`). `trained_from[k]`: sample k trains only its assistant turns from that index on."""
    if reasoning not in ("include", "drop"):
        raise DataError(f"reasoning: expected 'include' or 'drop', got {reasoning!r}")
    renderer = _Renderer(tokenizer)
    sequences: list[tuple[int, str, list[tuple[int, int]]]] = []
    for index, sample in enumerate(samples):
        start = trained_from[index] if trained_from is not None else 0
        for text, spans in _render_sample(sample, renderer, reasoning, index, start):
            sequences.append((index, text, spans))
    encodings = _encode([text for _, text, _ in sequences], tokenizer)
    out: list[TokenizedSample] = []
    sources: list[int] = []
    truncated = dropped = 0
    for (index, _text, spans), (ids, offsets) in zip(sequences, encodings):
        mask = _mask_from_offsets(offsets, spans)
        cut = len(ids) > max_length
        if cut:
            ids, mask = ids[:max_length], mask[:max_length]
            truncated += 1
        if not any(mask) and not keep_empty:
            dropped += 1
            continue
        out.append(TokenizedSample(input_ids=ids, loss_mask=mask, metadata=samples[index].metadata, truncated=cut))
        sources.append(index)
    return TokenizeResult(samples=out, truncated=truncated, dropped=dropped, sources=sources)


def render_chat(tokenizer: Any, messages: Sequence[Message], *, generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The template's text for `messages` (`posttrain.chat.render_chat`, its failure a `DataError`)."""
    try:
        return _render_chat(tokenizer, messages, generation_prompt=generation_prompt, tools=tools)
    except ChatTemplateError as error:
        raise DataError(str(error)) from error


def prompt_ids(tokenizer: Any, conversations: Sequence[Sequence[Message]],
               tools: list[dict[str, Any]] | None = None) -> list[list[int]]:
    """Each conversation rendered with the generation prompt and tokenized (no special tokens added: the
    template has them): what a model is prompted with to write the next assistant turn."""
    if not conversations:
        return []
    texts = [render_chat(tokenizer, messages, generation_prompt=True, tools=tools) for messages in conversations]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def conversation_for_training(sample: SFTSample, reasoning: Reasoning) -> list[Message]:
    """The messages as the template will see them: a content given as a list of text parts joined as the readers
    join it (`schema.text_of_parts`; a sample built in code need not have been read), and the reasoning trace put
    into (or left out of) the last reply."""
    messages = [_with_text_content(m, i) if isinstance(m.get("content"), list) else m
                for i, m in enumerate(sample.messages)]
    trace = sample.metadata.reasoning_trace
    if reasoning == "include" and trace:
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        reply = dict(messages[last])
        reply["content"] = f"{THINK_OPEN}{trace}{THINK_CLOSE}{reply.get('content') or ''}"
        messages[last] = reply
    return messages


def _with_text_content(message: Message, index: int) -> Message:
    try:
        return {**message, "content": text_of_parts(message["content"], f"messages[{index}].content")}
    except RecordError as error:
        raise DataError(str(error)) from None


def assistant_spans(
    messages: Sequence[Message], tokenizer: Any, tools: list[dict[str, Any]] | None = None, trained_from: int = 0
) -> list[tuple[str, list[tuple[int, int]]]]:
    """The training sequences of `messages`: each a rendered text with the character spans of the assistant
    replies it trains (one sequence for a prefix-stable template; see the module docstring)."""
    return _Renderer(tokenizer).sequences(messages, tools, trained_from)


class _Renderer:
    """Renders prefixes through the chat template, remembering each rendering for the batch.

    Several samples often share a prompt (many answers to one question, a common system prompt and first
    turns): their ``before`` renderings are then looked up instead of re-rendered. The last reply's
    ``upto`` is the whole conversation, rendered once.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.cache: dict[tuple, str] = {}
        # Given a partial, not the bound method: a renderer that its skeletons point back to is a reference cycle,
        # its cache freed only by the cyclic collector (a streaming run makes one renderer per chunk).
        self.skeletons = Skeletons(getattr(tokenizer, "chat_template", None), partial(_render_slow, tokenizer))

    def sequences(self, messages: Sequence[Message], tools: Any,
                  trained_from: int = 0) -> list[tuple[str, list[tuple[int, int]]]]:
        tools_key = json.dumps(tools, sort_keys=True) if tools else None
        keys = [_message_key(m) for m in messages]

        def render(end: int, generation_prompt: bool) -> str:
            return self.render(messages[:end], (generation_prompt, tools_key, *keys[:end]), generation_prompt, tools)

        full = render(len(messages), False)
        located = []  # (reply start, the rendering up to and including the reply)
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i < trained_from:
                continue
            before = render(i, True)
            upto = full if i == len(messages) - 1 else render(i + 1, False)
            try:
                require_prefix(before, upto, part=f"messages[:{i}] with the generation prompt",
                                    whole=f"messages[:{i + 1}]", purpose="the assistant reply cannot be located "
                                    "(the template changes the prompt when the reply is added)")
            except ChatTemplateError as error:
                raise DataError(str(error)) from None
            located.append((len(before), upto))
        # From the last turn back: a turn rendered as a prefix of the current sequence is marked in it.
        groups: list[tuple[str, list[tuple[int, int]]]] = []
        text, spans = full, []
        for start, upto in reversed(located):
            if not text.startswith(upto):
                if spans:
                    groups.append((text, spans[::-1]))
                text, spans = upto, []
            spans.append((start, len(upto)))
        if spans or not groups:
            groups.append((text, spans[::-1]))
        return groups[::-1]

    def render(self, messages: Sequence[Message], key: tuple, generation_prompt: bool, tools: Any) -> str:
        text = self.cache.get(key)
        if text is None:
            text = self.skeletons.render(messages, generation_prompt, tools, key[1])
            if text is None:
                text = _render_slow(self.tokenizer, messages, generation_prompt, tools)
            self.cache[key] = text
        return text


def _render_slow(tokenizer: Any, messages: Sequence[Message], generation_prompt: bool, tools: Any) -> str:
    return render_chat(tokenizer, messages, generation_prompt=generation_prompt, tools=tools)


def _message_key(message: Message) -> tuple:
    """What a rendering depends on in `message`, hashable: a content that is not a string (a list of parts passed
    to `assistant_spans` as it is, for the template to read) is keyed by its JSON."""
    calls = message.get("tool_calls")
    content = message.get("content")
    return (
        message["role"],
        content if content is None or isinstance(content, str) else json.dumps(content, sort_keys=True, default=str),
        json.dumps(calls, sort_keys=True) if calls else None,
        message.get("name"),
        message.get("tool_call_id"),
    )


def _render_sample(
    sample: SFTSample, renderer: _Renderer, reasoning: Reasoning, index: int, trained_from: int
) -> list[tuple[str, list[tuple[int, int]]]]:
    try:
        messages = conversation_for_training(sample, reasoning)
        return renderer.sequences(messages, sample.metadata.extras.get("tools"), trained_from)
    except DataError as error:
        where = sample.metadata.origin or f"sample {index} (source {sample.metadata.source})"
        raise DataError(f"{where}: {error}") from None


def _encode(texts: list[str], tokenizer: Any) -> list[tuple[list[int], list[tuple[int, int]]]]:
    if not texts:
        return []
    backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None and backend.truncation is None and backend.padding is None:
        # The Rust tokenizer's own batch call: transformers' wrapper converts every encoding to Python dicts
        # (a third of the time). Only when no truncation or padding is left set on it by an earlier call.
        return [(encoding.ids, encoding.offsets) for encoding in backend.encode_batch(texts, add_special_tokens=False)]
    try:
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as error:
        raise DataError(
            "the tokenizer cannot return character offsets (a slow, Python tokenizer); use its fast version"
        ) from error
    return list(zip(encoded["input_ids"], encoded["offset_mapping"]))


def _mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for tokens starting inside a span. Spans increase and do not overlap; the token starts almost always
    increase too, and then each span is two bisections and a slice (no Python loop over the tokens)."""
    starts = [start for start, _end in offsets]
    if starts != sorted(starts):
        return _mask_by_walk(starts, spans)
    mask = [0] * len(starts)
    for first, end in spans:
        low, high = bisect.bisect_left(starts, first), bisect.bisect_left(starts, end)
        mask[low:high] = [1] * (high - low)
    return mask


def _mask_by_walk(starts: list[int], spans: list[tuple[int, int]]) -> list[int]:
    mask = [0] * len(starts)
    span_index = 0
    for position, start in enumerate(starts):
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        if span_index == len(spans):
            break
        if start >= spans[span_index][0]:
            mask[position] = 1
    return mask
