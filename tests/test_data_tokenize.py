"""Tokenization through chat templates with loss on assistant tokens only (templates that rewrite earlier
turns: tests/test_chat_templates.py)."""

import copy
import time

import pytest

from posttrain.data import (
    DataError,
    assistant_spans,
    SampleMetadata,
    SFTSample,
    conversation_for_training,
    tokenize_sample,
    tokenize_samples,
)
from posttrain.models import train_tokenizer

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Reads a list-of-parts content itself (as multimodal templates do).
READS_PARTS = (
    "{% for message in messages %}[{{ message['role'] }}]{% if message['content'] is string %}"
    "{{ message['content'] }} {% else %}{% for part in message['content'] %}{{ part['text'] }} {% endfor %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
# Its generation prompt is not how it renders a reply's start: no reply can be located after the prompt.
PROMPT_CHANGES = (
    "{% for message in messages %}[{{ message['role'] }}]{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}[bot]{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    texts = [f"What is {a}+{b}? The answer is {a + b}. sunny weather tool" for a in range(50) for b in range(5)]
    return train_tokenizer(texts)


def two_turns(*contents: str) -> list[dict]:
    return [{"role": role, "content": c} for role, c in zip(["user", "assistant", "user", "assistant"], contents)]


def with_template(tokenizer, template):
    copied = copy.deepcopy(tokenizer)
    copied.chat_template = template
    return copied


def trained_text(tokenizer, tokenized) -> str:
    return tokenizer.decode([t for t, m in zip(tokenized.input_ids, tokenized.loss_mask) if m])


def arithmetic(trace=None) -> SFTSample:
    messages = [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": "12+34="},
        {"role": "assistant", "content": "46"},
    ]
    return SFTSample(messages, SampleMetadata(domain="arithmetic", reasoning_trace=trace))


def test_loss_covers_the_reply_and_its_end_of_turn_only(tokenizer):
    tokenized = tokenize_sample(arithmetic(), tokenizer, max_length=64)
    assert tokenizer.decode(tokenized.input_ids) == "<|system|>Add.<|end|><|user|>12+34=<|end|><|assistant|>46<|end|>"
    assert trained_text(tokenizer, tokenized) == "46<|end|>"
    assert tokenized.metadata.domain == "arithmetic" and not tokenized.truncated


def test_reasoning_trace_is_rendered_as_think_or_dropped(tokenizer):
    sample = arithmetic(trace="2+4=6, 1+3=4")
    included = tokenize_sample(sample, tokenizer, max_length=64, reasoning="include")
    assert trained_text(tokenizer, included) == "<think>2+4=6, 1+3=4</think>46<|end|>"
    dropped = tokenize_sample(sample, tokenizer, max_length=64, reasoning="drop")
    assert trained_text(tokenizer, dropped) == "46<|end|>"
    assert sample.messages[-1]["content"] == "46"  # the sample itself is not modified


def test_trace_goes_into_the_last_reply_of_a_multi_turn_sample():
    sample = SFTSample(two_turns("a", "b", "c", "d"), SampleMetadata(reasoning_trace="t"))
    rendered = conversation_for_training(sample, "include")
    assert [m["content"] for m in rendered] == ["a", "b", "c", "<think>t</think>d"]


def test_tool_calls_carry_loss_and_tool_results_do_not(tokenizer):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {"c": "x"}}}]},
        {"role": "tool", "name": "w", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    tokenized = tokenize_sample(SFTSample(messages), tokenizer, max_length=128)
    assert trained_text(tokenizer, tokenized) == (
        '<tool_call>{"name": "w", "arguments": {"c": "x"}}</tool_call><|end|>It is sunny.<|end|>'
    )


def test_any_prefix_stable_template_works(tokenizer):
    chatml = with_template(tokenizer, CHATML)
    tokenized = tokenize_sample(SFTSample(two_turns("12+34=", "46", "and 1+1?", "2")), chatml, max_length=256)
    assert trained_text(chatml, tokenized) == "46<|im_end|>\n2<|im_end|>\n"


def test_a_template_whose_prompt_changes_with_the_reply_is_refused(tokenizer):
    unstable = with_template(tokenizer, PROMPT_CHANGES)
    with pytest.raises(DataError, match="sample 0 .*not prefix-stable"):
        tokenize_samples([SFTSample(two_turns("a", "b", "c", "d"))], unstable, max_length=64)


def test_a_tokenizer_without_chat_template_is_an_error(tokenizer):
    with pytest.raises(DataError, match="no chat template"):
        tokenize_sample(arithmetic(), with_template(tokenizer, None), max_length=64)


def test_truncation_is_counted_and_samples_with_no_loss_left_are_dropped(tokenizer):
    samples = [arithmetic(), arithmetic(trace="2+4=6")]
    full = len(tokenize_sample(samples[0], tokenizer, max_length=64))
    result = tokenize_samples(samples, tokenizer, max_length=full - 1, reasoning="drop")
    assert result.truncated == 2 and result.dropped == 0
    assert all(len(s) == full - 1 and s.truncated and s.num_loss_tokens == 2 for s in result.samples)
    prompt_only = full - 3  # the reply "46<|end|>" is 3 tokens
    result = tokenize_samples(samples, tokenizer, max_length=prompt_only, reasoning="drop")
    assert result.dropped == 2 and result.samples == []
    assert result.report()["dropped_no_loss_tokens"] == 2


def test_batch_tokenization_is_fast_and_equals_one_by_one(tokenizer):
    samples = []
    for i in range(4000):
        a, b = i % 97, i // 97
        messages = [{"role": "user", "content": f"What is {a}+{b}?"}, {"role": "assistant", "content": f"The answer is {a + b}."}]
        samples.append(SFTSample(messages, SampleMetadata(reasoning_trace=f"{a}+{b}")))
    start = time.perf_counter()
    result = tokenize_samples(samples, tokenizer, max_length=128)
    elapsed = time.perf_counter() - start
    assert len(result.samples) == 4000
    assert elapsed < 20, f"{elapsed:.1f}s for 4000 samples"  # ~0.5 s on 2 cores; minutes would be a regression
    for index in (0, 1234, 3999):
        single = tokenize_sample(samples[index], tokenizer, max_length=128)
        assert (single.input_ids, single.loss_mask) == (result.samples[index].input_ids, result.samples[index].loss_mask)


def test_a_sample_built_in_code_with_list_of_parts_content_renders_as_its_joined_text(tokenizer):
    """A sample that was never read from a file (a task's messages, a library caller's) may keep OpenAI parts:
    it tokenizes as the readers' joined text would, a non-text part is a DataError naming the message, and
    `assistant_spans` (which hands contents to the template as they are) takes such a message too."""
    parts = [{"type": "text", "text": "12+34="}, {"type": "text", "text": "Add."}]
    built = SFTSample([{"role": "user", "content": parts}, {"role": "assistant", "content": [{"type": "text", "text": "46"}]}])
    joined = SFTSample(two_turns("12+34=\nAdd.", "46"))
    assert tokenize_sample(built, tokenizer, 64) == tokenize_sample(joined, tokenizer, 64)
    image = SFTSample([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
                       {"role": "assistant", "content": "46"}], SampleMetadata(source="mine"))
    with pytest.raises(DataError, match=r"messages\[0\]\.content\[0\].*image_url"):
        tokenize_samples([image], tokenizer, 64)
    [(text, spans)] = assistant_spans(built.messages, with_template(tokenizer, READS_PARTS))
    assert text == "[user]12+34= Add. [assistant]46 " and text[spans[0][0]:spans[0][1]] == "46 "
