"""Speed of a packed training step against the plain loop (unpacked, padded), tiny-3m in bf16 autocast on CPU.

Slow (a minute) and sensitive to other load on the machine; docs/data.md records the figures it prints.
The claim it guards: packed rows with variable-length attention train at least as many real tokens per
second as the plain padded loop, so packing never makes the trainer slower.
"""

import random
import statistics
import time

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from posttrain.models import varlen_attention_forward, varlen_mask
from posttrain.data import (
    SampleMetadata,
    SFTSample,
    build_epoch,
    collate,
    model_inputs,
    tokenize_samples,
)
from posttrain.models import build_tiny_model, train_tokenizer

AttentionInterface.register("posttrain_varlen", varlen_attention_forward)
AttentionMaskInterface.register("posttrain_varlen", varlen_mask(sdpa_mask))
TOKENS_PER_BATCH = 4096


def arithmetic_samples(count: int) -> list[SFTSample]:
    rng = random.Random(0)
    samples = []
    for _ in range(count):
        digits = rng.randint(1, 3)
        a, b = rng.randrange(10**digits), rng.randrange(10**digits)
        trace = " ".join(f"{x}+{y}={int(x) + int(y)}" for x, y in zip(str(a).zfill(digits), str(b).zfill(digits)))
        messages = [{"role": "user", "content": f"What is {a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"}]
        samples.append(SFTSample(messages, SampleMetadata(reasoning_trace=trace, difficulty=digits)))
    return samples


def batches(rows, count):
    out, current, tokens = [], [], 0
    for row in rows:
        current.append(row)
        tokens += len(row)
        if tokens >= TOKENS_PER_BATCH:
            out.append(current)
            current, tokens = [], 0
        if len(out) == count:
            break
    return out


def tokens_per_second(model, pad_id, attention, row_batches, how) -> float:
    model.set_attn_implementation(attention)
    real_tokens, start = 0, time.perf_counter()
    for rows in row_batches:
        batch = collate(rows, pad_id, block_mask_dtype=torch.float32 if how == "4d" else None)
        inputs = model_inputs(batch)
        if how == "padded":
            is_real = (batch["document_ids"] >= 0).long()
            inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"], "attention_mask": is_real}
        elif how == "position_ids":
            inputs = {key: inputs[key] for key in ("input_ids", "position_ids", "labels", "use_cache")}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        real_tokens += int((batch["document_ids"] >= 0).sum())
    return real_tokens / (time.perf_counter() - start)


@pytest.mark.slow
def test_packed_varlen_is_at_least_as_fast_as_the_plain_padded_loop():
    samples = arithmetic_samples(3000)
    tokenizer = train_tokenizer([s.messages[0]["content"] + s.messages[1]["content"] + s.metadata.reasoning_trace for s in samples])
    tokenized = tokenize_samples(samples, tokenizer, 512).samples
    model = build_tiny_model("tiny-3m", tokenizer).train()
    packed = batches(build_epoch(tokenized, epoch=0, seed=0, max_length=512, pack=True), 4)
    unpacked = batches(build_epoch(tokenized, epoch=0, seed=0, max_length=512, pack=False), 4)
    methods = {
        "padded sdpa": ("sdpa", unpacked, "padded"),
        "padded eager": ("eager", unpacked, "padded"),
        "packed sdpa position_ids": ("sdpa", packed, "position_ids"),
        "packed sdpa 4d": ("sdpa", packed, "4d"),
        "packed eager 4d": ("eager", packed, "4d"),
        "packed varlen cu_seq_lens": ("posttrain_varlen", packed, "cu_seq_lens"),
        "packed varlen position_ids": ("posttrain_varlen", packed, "position_ids"),
        "unpacked varlen": ("posttrain_varlen", unpacked, "cu_seq_lens"),
    }
    pad_id = tokenizer.pad_token_id
    figures: dict[str, list[float]] = {name: [] for name in methods}
    for round_ in range(3):  # interleaved rounds; the first warms up
        for name, (attention, rows, how) in methods.items():
            speed = tokens_per_second(model, pad_id, attention, rows, how)
            if round_:
                figures[name].append(speed)
    for name, speeds in figures.items():
        print(f"{name:28s} best {max(speeds):8.0f}  median {statistics.median(speeds):8.0f} tokens/s")
    plain_loop = max(max(figures["padded sdpa"]), max(figures["padded eager"]))
    assert max(figures["packed varlen cu_seq_lens"]) >= plain_loop
    assert max(figures["packed varlen position_ids"]) >= plain_loop
