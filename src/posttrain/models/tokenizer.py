"""The built-in tokenizer: byte-level BPE trained locally with `tokenizers`, with a chat template.

Digits are always split one per token (a pre-tokenizer rule), which is what lets a tiny model learn
column-wise arithmetic; everything else is byte-level BPE, so any text round-trips without an unknown
token. The result is a plain `PreTrainedTokenizerFast` that `AutoTokenizer.from_pretrained` loads.

Chat format (one special token per role, `<|end|>` closes every turn and is the eos token):

    <|system|>You are ...<|end|><|user|>12+34=<|end|><|assistant|><think>...</think>46<|end|>

Tool calls are rendered inside the assistant turn as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
and tool results come back as ``<|tool|>...<|end|>`` turns. The `tools` argument of `apply_chat_template`, when
given, is rendered as a system turn listing the tools' JSON schemas.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD = "<|pad|>"
END = "<|end|>"
ROLE_TOKENS = {role: f"<|{role}|>" for role in ("system", "user", "assistant", "tool")}
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SPECIAL_TOKENS = [PAD, END, *ROLE_TOKENS.values()]
# Not "special" (they decode as text and the model writes them), but kept as single tokens.
ADDED_TOKENS = [TOOL_CALL_OPEN, TOOL_CALL_CLOSE, THINK_OPEN, THINK_CLOSE]

# `tojson` keeps key order, so a tool call renders as {"name": ..., "arguments": ...}.
CHAT_TEMPLATE = (
    "{%- if tools -%}<|system|>You can call these tools: {{ tools | tojson }}<|end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "<|{{ message['role'] }}|>"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- endif -%}"
    "{%- if message.get('tool_calls') -%}{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call.get('function') else call -%}"
    "<tool_call>{{ {'name': fn['name'], 'arguments': fn['arguments']} | tojson }}</tool_call>"
    "{%- endfor -%}{%- endif -%}"
    "<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train the built-in byte-level BPE on `texts` and wrap it as a Hugging Face fast tokenizer."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + ADDED_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        eos_token=END,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        model_max_length=4096,
        padding_side="left",
        # No token_type_ids: decoders take none (transformers 4.x's generate rejects them when a tokenizer adds them).
        model_input_names=["input_ids", "attention_mask"],
    )
    # Non-special added tokens: single ids, but not stripped by `skip_special_tokens`.
    wrapped.add_tokens(ADDED_TOKENS)
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped
