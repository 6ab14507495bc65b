"""Assistant-only masks for chat templates that rewrite earlier turns: Qwen3 and Phi-3 behaviours.

The real Qwen3 and Phi-3 templates come with their models' tokenizers, which are not available here (no model
hub). The two templates below are test copies written for this file of the behaviours that matter, in the
shape the real ones have them:

* Qwen3: an assistant turn's ``<think>...</think>`` (taken out of its content) is rendered only for turns
  after the last user message; earlier turns lose their thinking. A turn after the last user message that is
  the last message always gets a think block, empty if it has none.
* Phi-3: ``<|user|>\\n...<|end|>\\n`` / ``<|assistant|>\\n...<|end|>\\n`` turns, then the generation prompt, or
  the eos token when there is no generation prompt (so eos follows only the last turn of a rendering).

Every test checks the exact text that carries loss: each assistant reply once, as the template renders it
when the reply is the latest turn (what the model is prompted to write), and nothing else.
"""

import copy

import pytest

from posttrain.data import SFTSample, prompt_ids, tokenize_samples
from posttrain.data.preference import PreferencePair, tokenize_pairs
from posttrain.models import train_tokenizer

QWEN3_LIKE = """\
{%- set ns = namespace(last_query_index=messages|length - 1) -%}
{%- for message in messages -%}{%- if message.role == 'user' -%}{%- set ns.last_query_index = loop.index0 -%}\
{%- endif -%}{%- endfor -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{%- set content = message.content -%}{%- set reasoning = '' -%}
{%- if '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) -%}
{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}
{%- else -%}
{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- endif -%}
{%- else -%}
{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"""

PHI3_LIKE = """\
{%- for message in messages -%}
{{ '<|' + message.role + '|>\\n' + message.content + '<|end|>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- else -%}{{ eos_token }}{%- endif -%}"""


@pytest.fixture(scope="module")
def tokenizer():
    texts = [f"What is {a}+{b}? Think: {a} plus {b}. The answer is {a + b}." for a in range(30) for b in range(5)]
    return train_tokenizer(texts)


def templated(tokenizer, template):
    copied = copy.deepcopy(tokenizer)
    copied.chat_template = template
    return copied


def trained_texts(tokenizer, result) -> list[str]:
    return [tokenizer.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m]) for s in result.samples]


def conversation(*contents: str) -> list[dict]:
    roles = ["user", "assistant"] * (len(contents) // 2)
    return [{"role": role, "content": content} for role, content in zip(roles, contents)]


THREE_TURNS = conversation("What is 1+2?", "<think>1 plus 2</think>The answer is 3.",
                           "What is 2+2?", "<think>2 plus 2</think>The answer is 4.",
                           "What is 3+1?", "The answer is 4.")


def test_qwen3_multi_turn_trains_each_reply_once_with_its_thinking(tokenizer):
    qwen3 = templated(tokenizer, QWEN3_LIKE)
    result = tokenize_samples([SFTSample(THREE_TURNS)], qwen3, max_length=512)
    assert trained_texts(qwen3, result) == [
        "<think>\n1 plus 2\n</think>\n\nThe answer is 3.<|im_end|>\n",
        "<think>\n2 plus 2\n</think>\n\nThe answer is 4.<|im_end|>\n",
        "<think>\n\n</think>\n\nThe answer is 4.<|im_end|>\n",
    ]
    assert result.sources == [0, 0, 0]
    # Each sequence is the conversation up to its reply, as the template renders it then: the last one holds
    # the earlier replies without their thinking, as context only.
    last = qwen3.decode(result.samples[-1].input_ids)
    assert "1 plus 2" not in last and last.count("The answer is") == 3


def test_qwen3_single_turn_is_one_sequence_the_whole_rendering(tokenizer):
    qwen3 = templated(tokenizer, QWEN3_LIKE)
    single = conversation("What is 2+2?", "<think>2 plus 2</think>The answer is 4.")
    result = tokenize_samples([SFTSample(single)], qwen3, max_length=512)
    assert trained_texts(qwen3, result) == ["<think>\n2 plus 2\n</think>\n\nThe answer is 4.<|im_end|>\n"]
    assert qwen3.decode(result.samples[0].input_ids) == qwen3.apply_chat_template(single, tokenize=False)


def test_phi3_multi_turn_trains_each_reply_with_the_eos_that_ends_it(tokenizer):
    phi3 = templated(tokenizer, PHI3_LIKE)
    eos = phi3.eos_token
    result = tokenize_samples([SFTSample(conversation("What is 1+2?", "The answer is 3.",
                                                      "What is 2+2?", "The answer is 4."))], phi3, max_length=512)
    assert trained_texts(phi3, result) == [f"The answer is 3.<|end|>\n{eos}", f"The answer is 4.<|end|>\n{eos}"]
    first = phi3.decode(result.samples[0].input_ids)
    assert first == f"<|user|>\nWhat is 1+2?<|end|>\n<|assistant|>\nThe answer is 3.<|end|>\n{eos}"


@pytest.mark.parametrize("template", [QWEN3_LIKE, PHI3_LIKE])
def test_dpo_locates_only_the_response_after_an_earlier_assistant_turn(tokenizer, template):
    chat = templated(tokenizer, template)
    prompt = THREE_TURNS[:5]  # holds two earlier replies with thinking
    pair = PreferencePair(prompt=prompt, chosen=[{"role": "assistant", "content": "The answer is 4."}],
                          rejected=[{"role": "assistant", "content": "The answer is 5."}])
    kept, tokens, _ = tokenize_pairs([pair], chat, max_length=512)
    assert len(kept) == 1
    (prompt_tokens,) = prompt_ids(chat, [prompt])
    assert tokens[0].prompt_length == len(prompt_tokens)
    assert tokens[0].chosen_ids[: len(prompt_tokens)] == prompt_tokens
    chosen = chat.decode([t for t, m in zip(tokens[0].chosen_ids, tokens[0].chosen_mask) if m])
    rejected = chat.decode([t for t, m in zip(tokens[0].rejected_ids, tokens[0].rejected_mask) if m])
    assert "The answer is 4." in chosen and "The answer is 5." in rejected
    assert "What is" not in chosen + rejected and "answer is 3" not in chosen
