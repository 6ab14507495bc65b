"""The chat-template skeleton fast path (`posttrain.data.skeleton`) changes no token and no loss-mask bit.

Every conversation below is tokenized twice, with the fast path and with it switched off (every rendering a
real ``apply_chat_template`` call), through the built-in tokenizer's template and through chat templates in
the shape of real ones: ChatML, a Qwen2.5-style template with tools and tool calls, a Llama-3-style one that
trims contents, and a Qwen3-style one that splits ``</think>`` out of replies (the last two must never take
the fast path, and give the same result anyway).
"""

import copy

import pytest

from posttrain.data import SampleMetadata, SFTSample, tokenize_samples, validate_record
from posttrain.data import skeleton
from posttrain.models import train_tokenizer
from posttrain.models.tokenizer import CHAT_TEMPLATE

from test_chat_templates import QWEN3_LIKE
from test_data_tokenize import CHATML

# Written for this file in the shape of Qwen2.5's template: a default system prompt, tools in the system turn,
# `message.content` tested for truthiness and pasted, tool calls serialized, tool results grouped in a user turn.
QWEN25_LIKE = """\
{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are a helpful assistant.{% endif %}
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% elif messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\
{% else %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}\
{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}{{ '<|im_start|>assistant' }}{% if message.content %}\
{{ '\\n' + message.content }}{% endif %}{% for call in message.tool_calls %}{% set fn = call.function or call %}\
{{ '\\n<tool_call>\\n' }}{{ {'name': fn.name, 'arguments': fn.arguments} | tojson }}{{ '\\n</tool_call>' }}\
{% endfor %}{{ '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}\
{{ '<|im_start|>user' }}{% endif %}{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}\
{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""

# In the shape of Llama 3's: contents are trimmed, so they are not pasted verbatim.
LLAMA3_LIKE = """\
{{ bos_token }}{% for message in messages %}\
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\
{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def conversations() -> list[SFTSample]:
    user, reply = "What is 12+34?", "46"
    chats = [
        [{"role": "user", "content": user}, {"role": "assistant", "content": reply}],
        [{"role": "system", "content": "Add."}, {"role": "user", "content": user},
         {"role": "assistant", "content": reply}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
         {"role": "user", "content": "  spaced \n"}, {"role": "assistant", "content": "\n<think>x</think> y "}],
        [{"role": "user", "content": "quotes \" ' {{ x }} {% if %} <|im_end|> \ue000 \\ \u00e9"},
         {"role": "assistant", "content": "<|end|> fine"}],
        [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [call("weather", city="x")]},
         {"role": "tool", "name": "weather", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}],
        [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "joined"}]}],
        [{"role": "user", "content": "empty reply"}, {"role": "assistant", "content": ""}],
    ]
    samples = [validate_record({"messages": chat}) for chat in chats]  # list-of-parts content joined as read
    samples += samples[:3]  # a shape met again: filled in from its skeleton
    samples += [SFTSample(samples[0].messages, SampleMetadata(extras={"tools": TOOLS})),
                SFTSample(samples[1].messages, SampleMetadata(reasoning_trace="12 and 34 make 46."))]
    samples += [SFTSample([{"role": "user", "content": f"What is {a}+7?"}, {"role": "assistant", "content": str(a + 7)}])
                for a in range(20)]
    return samples


@pytest.fixture(scope="module")
def tokenizer():
    texts = [f"What is {a}+{b}? The answer is {a + b}. sunny weather tool" for a in range(50) for b in range(5)]
    return train_tokenizer(texts)


def tokenized(tokenizer, samples, monkeypatch, fast: bool):
    with monkeypatch.context() as patch:
        if not fast:
            patch.setattr(skeleton, "content_is_opaque", lambda template: False)
        result = tokenize_samples(samples, tokenizer, max_length=1024, keep_empty=True)
    return [(s.input_ids, s.loss_mask) for s in result.samples], result.sources


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, CHATML, QWEN25_LIKE, LLAMA3_LIKE, QWEN3_LIKE],
                         ids=["built-in", "chatml", "qwen2.5-like", "llama3-like", "qwen3-like"])
def test_fast_path_gives_the_template_s_own_ids_and_masks(tokenizer, template, monkeypatch):
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = template
    samples = conversations()
    if template == CHATML:  # it renders no tool calls and no list content
        samples = [s for s in samples if all("tool_calls" not in m for m in s.messages)]
    fast = tokenized(templated, samples, monkeypatch, fast=True)
    slow = tokenized(templated, samples, monkeypatch, fast=False)
    assert fast == slow
    assert sum(sum(mask) for ids, mask in fast[0]) > 0


def test_templates_that_look_into_contents_never_take_the_fast_path():
    assert skeleton.content_is_opaque(CHAT_TEMPLATE)
    assert skeleton.content_is_opaque(CHATML)
    assert skeleton.content_is_opaque(QWEN25_LIKE)
    assert not skeleton.content_is_opaque(LLAMA3_LIKE)  # | trim
    assert not skeleton.content_is_opaque(QWEN3_LIKE)  # splits </think> out of the content
    assert not skeleton.content_is_opaque("{{ messages | tojson }}")
    assert not skeleton.content_is_opaque("{% for m in messages %}{{ m.content[1:] }}{% endfor %}")
    assert not skeleton.content_is_opaque("{% for m in messages %}{% set c = m.content %}{{ c }}{% endfor %}")
    assert not skeleton.content_is_opaque("{% for m in messages %}{% if 'x' in m.content %}y{% endif %}{% endfor %}")
    assert not skeleton.content_is_opaque("{% for m in messages %}{{ m.content and 'x' }}{% endfor %}")
    assert not skeleton.content_is_opaque("{% for m in messages %}{% for k, v in m.items() %}{{ v | trim }}"
                                          "{% endfor %}{% endfor %}")
    assert not skeleton.content_is_opaque("{% set ns = namespace(m=none) %}{% for m in messages %}{% set ns.m = m %}"
                                          "{% endfor %}{{ ns.m.content | trim }}")
    assert not skeleton.content_is_opaque("{% for m in messages %}{% filter trim %}{{ m.content }}{% endfilter %}"
                                          "{% endfor %}")
    assert not skeleton.content_is_opaque("{% for m in messages %}{% set x %}{{ m.content }}{% endset %}{{ x[1:] }}"
                                          "{% endfor %}")
    assert not skeleton.content_is_opaque("{% for m in messages %}{{ loop.previtem.content | trim if loop.previtem }}"
                                          "{% endfor %}")


def test_one_template_call_per_shape_not_per_sample(tokenizer):
    calls = []
    counting = copy.deepcopy(tokenizer)
    original = counting.apply_chat_template
    counting.apply_chat_template = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    samples = [SFTSample([{"role": "user", "content": f"What is {a}+7?"}, {"role": "assistant", "content": str(a + 7)}])
               for a in range(200)]
    tokenize_samples(samples, counting, max_length=64)
    # Two shapes (the prompt with the generation prompt, the whole chat): a skeleton and a check call each.
    assert len(calls) == 4
