"""Long prompts in the engine: chunked prefill computes what a one-pass prefill computes, a KV cache kept in the
model's dtype gives the same samples at half the memory, and the engine reports its peak KV memory."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import build_tiny_model
from posttrain.rollout import HFEngine
from posttrain.train.forward import target_logprobs
from posttrain.types import GenerationRequest, SamplingParams


pytestmark = pytest.mark.usefixtures("one_thread")


def model_for(tokenizer):
    model = build_tiny_model("tiny-1m", tokenizer, seed=1).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    return model


PROMPTS = [[(7 * i) % 290 + 5 for i in range(75)], [(13 * i) % 280 + 9 for i in range(41)]]
SAMPLING = SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=3)


def generate(engine):
    return engine.generate([GenerationRequest(p) for p in PROMPTS], SAMPLING)


def test_chunked_prefill_equals_one_pass_and_the_teacher_forced_forward(tiny_tokenizer):
    model = model_for(tiny_tokenizer)
    one_pass = generate(HFEngine(model, tiny_tokenizer, prefill_chunk=None))
    chunked = generate(HFEngine(model, tiny_tokenizer, prefill_chunk=16))  # 5 passes, padding in the first
    for prompt, group_a, group_b in zip(PROMPTS, one_pass, chunked):
        for a, b in zip(group_a, group_b):
            assert a.token_ids == b.token_ids
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
            sequence = prompt + b.token_ids
            with torch.no_grad():
                logits = model(torch.tensor([sequence]), use_cache=False).logits[0, :-1].float()
            expected = target_logprobs(logits, torch.tensor(sequence[1:]))[len(prompt) - 1 :]
            assert torch.allclose(torch.tensor(b.logprobs), expected, atol=1e-4)


def test_a_cache_in_the_model_dtype_samples_the_same_at_half_the_memory(tiny_tokenizer):
    model = model_for(tiny_tokenizer)
    wide = HFEngine(model, tiny_tokenizer, autocast="bfloat16", kv_cache_dtype="float32")
    narrow = HFEngine(model, tiny_tokenizer, autocast="bfloat16", kv_cache_dtype="model")
    for a_group, b_group in zip(generate(wide), generate(narrow)):
        for a, b in zip(a_group, b_group):
            assert a.token_ids == b.token_ids  # the cached values are bf16-rounded either way
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    assert wide.stats.kv_cache_dtype == "float32" and narrow.stats.kv_cache_dtype == "bfloat16"
    assert narrow.stats.peak_kv_mb == pytest.approx(wide.stats.peak_kv_mb / 2)
    layers, heads, head_dim = model.config.num_hidden_layers, model.config.num_key_value_heads, 32
    columns = 75 * 2 + 12 * 4  # two prompts padded to 75, and 4 rows of 12 generated columns
    assert wide.stats.peak_kv_mb * 2**20 == 2 * layers * columns * heads * head_dim * 4


def test_auto_keeps_the_model_dtype_past_the_memory_bound_and_fp32_below(tiny_tokenizer):
    model = model_for(tiny_tokenizer)
    small = HFEngine(model, tiny_tokenizer, autocast="bfloat16")
    bounded = HFEngine(model, tiny_tokenizer, autocast="bfloat16", kv_widen_limit_mb=0.01)
    generate(small), generate(bounded)
    assert small.stats.kv_cache_dtype == "float32"
    assert bounded.stats.kv_cache_dtype == "bfloat16"
    fp32 = HFEngine(model, tiny_tokenizer, kv_widen_limit_mb=0.01)  # no autocast: the model's dtype is fp32
    generate(fp32)
    assert fp32.stats.kv_cache_dtype == "float32"


def test_the_generic_runner_reports_its_peak_kv_memory(tiny_tokenizer):
    engine = HFEngine(model_for(tiny_tokenizer), tiny_tokenizer, runner="generic")
    generate(engine)
    assert engine.stats.peak_kv_mb > 0
