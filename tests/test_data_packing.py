"""Packing: rows, collation, masks, and the proof that a packed batch trains exactly like its samples one by one."""

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from posttrain.models import segments_from_positions, varlen_attention_forward, varlen_mask
from posttrain.data import (
    IGNORE_INDEX,
    DataError,
    SampleMetadata,
    TokenizedSample,
    block_causal_mask,
    build_epoch,
    collate,
    cu_seq_lens,
    model_inputs,
)
from posttrain.models import build_tiny_model, train_tokenizer

AttentionInterface.register("posttrain_varlen", varlen_attention_forward)
AttentionMaskInterface.register("posttrain_varlen", varlen_mask(sdpa_mask))


def sample(length: int, first_id: int = 10, prompt: int = 3) -> TokenizedSample:
    ids = [first_id + (i % 50) for i in range(length)]
    mask = [0] * min(prompt, length) + [1] * max(0, length - prompt)
    return TokenizedSample(input_ids=ids, loss_mask=mask, metadata=SampleMetadata(domain="d"))


def test_rows_restart_positions_and_number_documents():
    rows = build_epoch([sample(5), sample(3), sample(4)], epoch=0, seed=0, max_length=12, pack=True)
    assert len(rows) == 1
    row = rows[0]
    assert len(row) == 12 and row.num_documents == 3
    starts = [i for i, p in enumerate(row.position_ids) if p == 0]
    assert len(starts) == 3
    for doc, start in enumerate(starts):
        assert row.document_ids[start] == doc


def test_packing_is_deterministic_fills_well_and_keeps_every_sample():
    samples = [sample(n, first_id=n) for n in [3, 7, 11, 2, 30, 17, 9, 25, 4, 12, 8, 20, 6, 1, 14] * 8]
    rows = build_epoch(samples, epoch=3, seed=7, max_length=32, pack=True)
    assert rows == build_epoch(samples, epoch=3, seed=7, max_length=32, pack=True)
    assert rows != build_epoch(samples, epoch=4, seed=7, max_length=32, pack=True)
    assert all(len(r) <= 32 for r in rows)
    total = sum(len(s) for s in samples)
    assert sum(len(r) for r in rows) == total
    assert total / (len(rows) * 32) > 0.95  # best-fit decreasing leaves little room
    assert sum(r.num_documents for r in rows) == len(samples)


def test_unpacked_epoch_is_one_sample_per_row_shuffled_by_epoch():
    samples = [sample(n + 2, first_id=n) for n in range(20)]
    rows = build_epoch(samples, epoch=0, seed=0, max_length=32, pack=False)
    assert len(rows) == 20 and all(r.num_documents == 1 for r in rows)
    assert [r.input_ids for r in rows] != [s.input_ids for s in samples]


def test_sample_longer_than_max_length_is_an_error():
    with pytest.raises(DataError, match="more than max_length=8"):
        build_epoch([sample(9)], epoch=0, seed=0, max_length=8, pack=True)


def test_collate_labels_positions_and_padding():
    rows = build_epoch([sample(5), sample(4)], epoch=0, seed=0, max_length=9, pack=True)
    rows += build_epoch([sample(3)], epoch=0, seed=0, max_length=9, pack=True)
    batch = collate(rows, pad_id=0, pad_to_multiple_of=8)
    assert batch["input_ids"].shape == (2, 16) and batch["num_tokens"] == 12
    labels, positions, docs = batch["labels"], batch["position_ids"], batch["document_ids"]
    assert (labels[positions == 0] == IGNORE_INDEX).all()  # never across a sample boundary
    assert (labels[docs < 0] == IGNORE_INDEX).all() and (docs[1, 3:] == -1).all()
    trained = labels != IGNORE_INDEX
    assert torch.equal(labels[trained], batch["input_ids"][trained])
    assert int(trained.sum()) == (5 - 3) + (4 - 3) + (3 - 3)
    # Segments: the row-0 samples, then row 1's sample and each of its padding tokens alone.
    lengths = (batch["cu_seq_lens"][1:] - batch["cu_seq_lens"][:-1]).tolist()
    assert lengths == [rows[0].position_ids.index(0, 1), 9 - rows[0].position_ids.index(0, 1)] + [1] * 7 + [3] + [1] * 13


def test_cu_seq_lens_splits_rows_even_with_equal_document_ids():
    docs = torch.tensor([[0, 0, 1], [0, 0, -1]])
    assert cu_seq_lens(docs).tolist() == [0, 2, 3, 5, 6]
    positions = torch.tensor([[0, 1, 0], [0, 1, 0]])
    assert segments_from_positions(positions).tolist() == [0, 2, 3, 5, 6]


def test_block_causal_mask_blocks_other_samples_and_padding():
    docs = torch.tensor([[0, 0, 1, 1, -1]])
    allowed = block_causal_mask(docs, torch.bool)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 0, 1],  # padding sees itself only: no fully masked row, no NaN
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)
    additive = block_causal_mask(docs, torch.float32)[0, 0]
    assert (additive[expected] == 0).all() and (additive[~expected] == torch.finfo(torch.float32).min).all()


def test_varlen_kernel_matches_masked_attention_with_grouped_heads():
    generator = torch.Generator().manual_seed(0)
    lengths = [[1, 40, 3, 17], [64], [2, 2, 9]]  # widely spread: several buckets, and single tokens
    width = 64
    docs = torch.full((len(lengths), width), -1)
    for b, row in enumerate(lengths):
        start = 0
        for d, n in enumerate(row):
            docs[b, start : start + n] = d
            start += n
    query = torch.randn(len(lengths), 4, width, 8, generator=generator)
    key, value = (torch.randn(len(lengths), 2, width, 8, generator=generator) for _ in range(2))
    module = torch.nn.Linear(1, 1)
    out, _ = varlen_attention_forward(module, query, key, value, None, cu_seq_lens_q=cu_seq_lens(docs))
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=block_causal_mask(docs, torch.bool)
    ).transpose(1, 2)
    real = docs >= 0
    torch.testing.assert_close(out[real], expected[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masked_attention_on_cpu_matches_sdpa(kind):
    """A padded batch's 4D mask takes the matmul path on CPU (faster there than sdpa's masked kernel): same
    outputs as sdpa, with queries after cached keys and left padding."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4, 5, 8, generator=generator)
    key, value = (torch.randn(3, 2, 7, 8, generator=generator) for _ in range(2))
    visible = torch.ones(5, 7, dtype=torch.bool).tril(2)[None, None].repeat(3, 1, 1, 1)
    visible[0, :, :, :2] = False  # a left-padded row
    mask = visible if kind == "bool" else torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    out, _ = varlen_attention_forward(torch.nn.Linear(1, 1), query, key, value, mask)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=mask
    ).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny():
    tokenizer = train_tokenizer([f"{a} plus {b} is {a + b}." for a in range(60) for b in range(6)])
    model = build_tiny_model("tiny-1m", tokenizer, seed=0).float().eval()
    return tokenizer, model


def _samples(vocab: int) -> list[TokenizedSample]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for length in [9, 23, 5, 17, 30, 12, 8, 26, 14, 3]:
        ids = torch.randint(10, vocab, (length,), generator=generator).tolist()
        prompt = max(1, length // 3)
        out.append(TokenizedSample(ids, [0] * prompt + [1] * (length - prompt)))
    return out


@pytest.fixture(scope="module")
def reference(tiny):
    """Per-sample logits and the mean loss over all trained tokens, one sample per forward (plain sdpa)."""
    tokenizer, model = tiny
    model.set_attn_implementation("sdpa")
    logits, total, count = [], 0.0, 0
    with torch.no_grad():
        for s in _samples(len(tokenizer)):
            batch = collate(build_epoch([s], epoch=0, seed=0, max_length=64, pack=False), pad_id=0)
            out = model(input_ids=batch["input_ids"], labels=batch["labels"])
            tokens = int((batch["labels"] != IGNORE_INDEX).sum())
            total += float(out.loss) * tokens
            count += tokens
            logits.append(out.logits[0])
    return logits, total / count


@pytest.mark.parametrize(
    "attention, how",
    [
        ("sdpa", "model_inputs"),
        ("sdpa", "4d_mask"),
        ("sdpa", "position_ids"),
        ("eager", "4d_mask"),
        ("eager", "model_inputs"),
        ("posttrain_varlen", "model_inputs"),
        ("posttrain_varlen", "position_ids"),
    ],
)
def test_packed_loss_and_logits_equal_unpacked(tiny, reference, attention, how):
    tokenizer, model = tiny
    samples = _samples(len(tokenizer))
    reference_logits, reference_loss = reference

    model.set_attn_implementation(attention)
    rows = build_epoch(samples, epoch=0, seed=1, max_length=40, pack=True)
    assert max(r.num_documents for r in rows) > 1
    batch = collate(rows, tokenizer.pad_token_id, block_mask_dtype=torch.float32 if how == "4d_mask" else None)
    inputs = model_inputs(batch)
    if how == "position_ids":  # what a trainer passing only positions gets (no cu_seq_lens)
        inputs = {key: inputs[key] for key in ("input_ids", "position_ids", "labels", "use_cache")}
    with torch.no_grad():
        out = model(**inputs)
    assert torch.isfinite(out.logits).all()
    assert abs(float(out.loss) - reference_loss) < 1e-5
    seen = 0
    for b, row in enumerate(rows):
        starts = [i for i, p in enumerate(row.position_ids) if p == 0] + [len(row)]
        for start, end in zip(starts[:-1], starts[1:]):
            ids = row.input_ids[start:end]
            match = next(i for i, s in enumerate(samples) if s.input_ids == ids)
            torch.testing.assert_close(out.logits[b, start:end], reference_logits[match], atol=1e-5, rtol=1e-5)
            seen += 1
    assert seen == len(samples)
    model.set_attn_implementation("sdpa")


def test_packed_gradients_equal_unpacked_with_varlen(tiny):
    tokenizer, model = tiny
    samples = _samples(len(tokenizer))
    model.set_attn_implementation("sdpa")
    model.zero_grad()
    singles = [collate(build_epoch([s], epoch=0, seed=0, max_length=64, pack=False), pad_id=0) for s in samples]
    total_tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in singles)
    for batch in singles:
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
        tokens = int((batch["labels"] != IGNORE_INDEX).sum())
        (out.loss * tokens / total_tokens).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_attn_implementation("posttrain_varlen")
    batch = collate(build_epoch(samples, epoch=0, seed=1, max_length=40, pack=True), tokenizer.pad_token_id)
    model(**model_inputs(batch)).loss.backward()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, reference[name], atol=1e-5, rtol=1e-4, msg=name)
    model.zero_grad()
    model.set_attn_implementation("sdpa")


def test_varlen_attention_generates_like_sdpa(tiny):
    tokenizer, model = tiny
    prompts = [[5, 9, 13, 20, 7], [11, 4, 8]]
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")  # left padding, as in generation
    outputs = {}
    for attention in ("sdpa", "posttrain_varlen"):
        model.set_attn_implementation(attention)
        outputs[attention] = model.generate(**batch, max_new_tokens=6, do_sample=False)
    assert torch.equal(outputs["sdpa"], outputs["posttrain_varlen"])
    model.set_attn_implementation("sdpa")


def test_a_plain_padding_mask_would_leak_across_samples(tiny, reference):
    """The check above can fail: with a 2D padding mask, packed samples see each other and the loss moves."""
    tokenizer, model = tiny
    samples = _samples(len(tokenizer))
    model.set_attn_implementation("sdpa")
    _, reference_loss = reference
    batch = collate(build_epoch(samples, epoch=0, seed=1, max_length=40, pack=True), tokenizer.pad_token_id)
    leaky = {**model_inputs(batch), "attention_mask": (batch["document_ids"] >= 0).long()}
    with torch.no_grad():
        assert abs(float(model(**leaky).loss) - reference_loss) > 1e-3
