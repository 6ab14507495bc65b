"""The loss in chunks over the sequence (`train.chunked`): the same loss and gradients as the unchunked one,
for SFT and for the RL step's log-probs and entropies, without ever saving a [tokens, vocab] tensor for the
backward; and packed long rows give each document the loss it has alone."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.data import collate
from posttrain.data.packing import Row
from posttrain.models import build_tiny_model, set_attention
from posttrain.train import scored_token_stats, sft_loss_sum


pytestmark = pytest.mark.usefixtures("one_thread")


def model_for(tokenizer, attention: str = "eager"):
    model = build_tiny_model("tiny-1m", tokenizer, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # sharper logits: differences in the softmax show
    set_attention(model, attention, torch.device("cpu"))
    return model


def packed_row(documents: list[list[int]]) -> Row:
    row = Row([], [], [], [])
    for index, document in enumerate(documents):
        row.input_ids += document
        row.loss_mask += [0] * 3 + [1] * (len(document) - 3)  # a "prompt" of 3 untrained tokens each
        row.position_ids += list(range(len(document)))
        row.document_ids += [index] * len(document)
    return row


def documents(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 300, (length + 7 * i,), generator=generator).tolist() for i in range(count)]


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a: dict, b: dict, tolerance: float = 1e-5) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        scale = max(1e-6, float(a[name].abs().max()))
        assert float((a[name] - b[name]).abs().max()) <= tolerance * scale, name


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_sft_loss_and_gradients_equal_the_unchunked(chunk, tiny_tokenizer):
    batch = collate([packed_row(documents(3, 30, 0)), packed_row(documents(2, 41, 1))], pad_id=0)
    reference, chunked = model_for(tiny_tokenizer), model_for(tiny_tokenizer)
    full_loss, full_count = sft_loss_sum(reference, batch, chunk_tokens=None)
    full_loss.backward()
    loss, count = sft_loss_sum(chunked, batch, chunk_tokens=chunk)
    loss.backward()
    assert count == full_count > chunk
    assert torch.allclose(loss, full_loss, rtol=1e-6)
    assert_same_grads(grads(chunked), grads(reference))


def test_chunked_rl_logprobs_entropy_and_gradients_equal_the_unchunked(tiny_tokenizer):
    """The RL step's per-token quantities at a sampling temperature, through a weighted sum with an entropy
    bonus (what the policy loss backpropagates through)."""
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(10, 300, (3, 50), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding on one row
    select = torch.zeros(3, 49, dtype=torch.bool)
    select[:, 20:] = True
    targets = ids[:, 1:][select]
    weights = torch.linspace(-1, 1, targets.numel())
    outputs = {}
    for chunk in (None, 9):
        model = model_for(tiny_tokenizer)
        stats = scored_token_stats(model, ids, select, targets, temperature=0.7, entropy=True, chunk_tokens=chunk,
                                   attention_mask=mask)
        ((stats.logprobs * weights).sum() + 0.1 * stats.entropy.sum()).backward()
        outputs[chunk] = (stats.logprobs.detach(), stats.entropy.detach(), grads(model))
    (lp_full, ent_full, g_full), (lp, ent, g) = outputs[None], outputs[9]
    assert torch.allclose(lp, lp_full, atol=1e-5) and torch.allclose(ent, ent_full, atol=1e-5)
    assert_same_grads(g, g_full)


def _largest_saved(fn, vocab: int) -> int:
    """The most elements of any one vocabulary-wide tensor (logits, probabilities: last dimension `vocab`)
    autograd saves for the backward while `fn` runs."""
    largest = 0

    def pack(tensor):
        nonlocal largest
        if tensor.dim() and tensor.shape[-1] == vocab:
            largest = max(largest, tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return largest


def test_no_tokens_by_vocab_tensor_is_saved_for_the_backward(tiny_tokenizer):
    model = model_for(tiny_tokenizer, attention="posttrain_varlen")
    batch = collate([packed_row(documents(4, 60, 2))], pad_id=0)
    trained = int((batch["labels"] != -100).sum())
    vocab = model.config.vocab_size
    chunk = 32
    unchunked = _largest_saved(lambda: sft_loss_sum(model, batch, chunk_tokens=None), vocab)
    chunked = _largest_saved(lambda: sft_loss_sum(model, batch, chunk_tokens=chunk), vocab)
    assert unchunked >= trained * vocab  # the check can fail: the plain loss does save the whole logits
    assert chunked <= chunk * vocab < trained * vocab / 4  # checkpointed chunks: only their hidden states


def test_packed_long_documents_get_the_loss_they_have_alone(tiny_tokenizer):
    """Variable-length attention over a packed row (documents past `LONG_SEGMENT`, the fused-kernel path)
    gives each document exactly its own loss: no attention across documents."""
    from posttrain.models.attention import LONG_SEGMENT

    docs = [d[: LONG_SEGMENT + 40 + 13 * i] for i, d in enumerate(documents(2, LONG_SEGMENT + 60, 4))]
    docs.append(documents(1, 90, 9)[0])
    model = model_for(tiny_tokenizer, attention="posttrain_varlen")
    packed = collate([packed_row(docs)], pad_id=0)
    loss, count = sft_loss_sum(model, packed)
    alone, alone_count = 0.0, 0
    eager = copy.deepcopy(model)
    set_attention(eager, "eager", torch.device("cpu"))
    for document in docs:
        summed, n = sft_loss_sum(eager, collate([packed_row([document])], pad_id=0))
        alone, alone_count = alone + float(summed), alone_count + n
    assert count == alone_count
    assert abs(float(loss) - alone) <= 1e-5 * abs(alone)
    # and the documents do interact when the boundaries are dropped (the check has teeth)
    merged = packed_row(docs)
    merged.document_ids = [0] * len(merged.document_ids)
    merged.position_ids = list(range(len(merged.position_ids)))
    leaky, _ = sft_loss_sum(model, collate([merged], pad_id=0))
    assert abs(float(leaky) - alone) > 1e-3 * abs(alone)


def test_peak_memory_sees_a_step_allocation_and_divides_it_by_tokens():
    from posttrain.train import PeakMemory

    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    block = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched: fresh pages (an allocation this large is mapped)
    figures = memory.figures(micro_batch_tokens=1024)
    assert figures["peak_memory_mb"] >= 256
    # the step's own 256 MiB show above the memory held at its start: 256 KiB for each of 1,024 tokens
    assert 240 <= figures["activation_kb_per_token"] <= 400
    del block


def test_the_fused_sft_head_matches_autograd_under_bf16_autocast(tiny_tokenizer):
    """The fused head reproduces autocast's numerics by hand (bf16 matmuls, fp32 softmax): against the
    checkpointed chunks (plain autograd under autocast), within bf16 rounding."""
    from posttrain.train import scored_token_stats
    from posttrain.train.chunked import summed_cross_entropy

    batch = collate([packed_row(documents(3, 30, 6))], pad_id=0)
    inputs = {key: batch[key] for key in ("position_ids",)}
    select = batch["labels"][:, 1:] != -100
    targets = batch["labels"][:, 1:][select]
    results = []
    for fused in (True, False):
        model = model_for(tiny_tokenizer)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                loss = summed_cross_entropy(model, batch["input_ids"], select, targets, chunk_tokens=16, **inputs)
            else:
                loss = -scored_token_stats(model, batch["input_ids"], select, targets, chunk_tokens=16,
                                           **inputs).logprobs.sum()
        loss.backward()
        results.append((float(loss.detach()), grads(model)))
    (fused_loss, fused_grads), (plain_loss, plain_grads) = results
    assert abs(fused_loss - plain_loss) <= 1e-3 * abs(plain_loss)
    assert_same_grads(fused_grads, plain_grads, tolerance=3e-2)


def test_the_head_runs_twice_only_where_checkpointing_saves_memory(tiny_tokenizer):
    """Scored tokens that fit in one chunk are not checkpointed (the head runs once, forward and backward
    included); several chunks recompute each chunk's logits in the backward (twice per chunk)."""
    ids = torch.randint(10, 300, (2, 30), generator=torch.Generator().manual_seed(3))
    select = torch.ones(2, 29, dtype=torch.bool)
    targets = ids[:, 1:][select]  # 58 scored tokens
    counts = {}
    for chunk in (64, 20):
        model = model_for(tiny_tokenizer)
        calls = []
        model.lm_head.register_forward_hook(lambda *_: calls.append(1))
        stats = scored_token_stats(model, ids, select, targets, chunk_tokens=chunk)
        stats.logprobs.sum().backward()
        counts[chunk] = len(calls)
    assert counts == {64: 1, 20: 6}  # 58 tokens: one piece; three chunks of at most 20, each run twice
