"""Variable-length attention for packed rows: each sample attends only to itself, and masked blocks cost nothing.

A packed batch ``[B, T]`` holds many samples per row. Attention with a block-diagonal 4D mask computes all
``T x T`` scores per row and throws most away; on CPU it is also where sdpa is slowest (measured in
docs/data.md). This kernel works on segments instead: the samples of the flattened ``B*T`` tokens, given as
flash-attention-style boundaries ``cu_seq_lens_q`` (`posttrain.data.cu_seq_lens`; every padding token is a
segment of its own) or, when there is none and no mask either, read off `position_ids` the way transformers
detects packing (a new segment wherever a position is not the previous one plus 1). It gathers the segments
into a few length buckets (sorted by length, padded to the bucket's longest), runs causal attention per
bucket, and scatters the outputs back:

    out[s] = softmax(q_s k_s^T * scale + causal) v_s      for every segment s

Bucket padding sits after each segment's real tokens, so causality alone keeps real queries from seeing it.
On CPU the per-bucket attention is plain matmul + fp32 softmax (faster there than the fused sdpa kernel in
bf16); on other devices it is `scaled_dot_product_attention` with ``is_causal``.

It plugs into transformers (>= 5) as an attention implementation for causal decoders with full attention
(Llama and the like). Given a 4D mask, or a KV cache longer than the query (generation), it is ordinary sdpa
over that mask, so one model trains packed and generates. `varlen_mask` wraps transformers' mask builder so
that no 4D mask is built when the caller gave no padding mask (a packed training batch):

    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    AttentionInterface.register("posttrain_varlen", varlen_attention_forward)
    AttentionMaskInterface.register("posttrain_varlen", varlen_mask(sdpa_mask))
    model.set_attn_implementation("posttrain_varlen")
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

NUM_BUCKETS = 4


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention with transformers' signature: ``query [B, H, T, D]``, key/value ``[B, H_kv, S, D]``;
    returns ``([B, T, H, D], None)``."""
    batch, heads, length, head_dim = query.shape
    key, value = _repeat_kv(key, heads), _repeat_kv(value, heads)
    if key.shape[2] != length:  # queries after cached keys: generation
        return _dense_attention(query, key, value, attention_mask, dropout, scaling)
    if cu_seq_lens_q is None and attention_mask is None and position_ids is not None:
        cu_seq_lens_q = segments_from_positions(position_ids.expand(batch, -1))
    if cu_seq_lens_q is None:
        return _dense_attention(query, key, value, attention_mask, dropout, scaling)
    if int(cu_seq_lens_q[-1]) != batch * length:
        raise ValueError(f"cu_seq_lens_q covers {int(cu_seq_lens_q[-1])} tokens, the batch has {batch * length}")
    scale = scaling if scaling is not None else head_dim**-0.5

    def flat(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [B*T, H, D]
        return x.transpose(1, 2).reshape(batch * length, heads, head_dim)

    q, k, v = flat(query), flat(key), flat(value)
    buckets, scatter = _plan(cu_seq_lens_q.to(torch.long))
    pieces = []
    for gather, count, width in buckets:
        shape = (count, width, heads, head_dim)
        q_b, k_b, v_b = (x.index_select(0, gather).view(shape).transpose(1, 2) for x in (q, k, v))
        out = _causal_attention(q_b, k_b, v_b, scale, dropout)
        pieces.append(out.transpose(1, 2).reshape(count * width, heads, head_dim))
    output = torch.cat(pieces).index_select(0, scatter)
    return output.view(batch, length, heads, head_dim), None


def segments_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment boundaries of the flattened ``[B, T]`` positions: a segment starts at every row and wherever a
    position is not the previous one plus 1 (a packed sample restarting at 0, or a padding token)."""
    batch, width = position_ids.shape
    starts = torch.ones(batch, width, dtype=torch.bool, device=position_ids.device)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    boundaries = torch.nonzero(starts.reshape(-1)).flatten()
    end = torch.tensor([batch * width], dtype=boundaries.dtype, device=position_ids.device)
    return torch.cat([boundaries, end])


def varlen_mask(dense_mask: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a transformers mask builder (``sdpa_mask``): no mask when the caller passed no padding mask, so the
    attention reads the samples off `position_ids`; the dense mask otherwise (padded generation)."""

    def mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if attention_mask is None:
            return None
        return dense_mask(*args, attention_mask=attention_mask, **kwargs)

    return mask


def _plan(cu: torch.Tensor) -> tuple[list[tuple[torch.Tensor, int, int]], torch.Tensor]:
    """Buckets ``(gather_index, count, width)`` and the scatter index (token -> row of the bucket outputs).

    Segments are sorted by length and cut into up to `NUM_BUCKETS` buckets of equal count; length-1 segments
    (padding, mostly) form a bucket of their own, where attention is the identity on the value.
    """
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    order = torch.argsort(lengths, stable=True)
    starts, lengths = starts[order], lengths[order]
    singles = int((lengths == 1).sum())
    rest = lengths.numel() - singles
    bounds = [0, singles] + [singles + (rest * i) // NUM_BUCKETS for i in range(1, NUM_BUCKETS + 1)]
    scatter = torch.empty(int(cu[-1]), dtype=torch.long, device=cu.device)
    buckets, base = [], 0
    for low, high in zip(bounds[:-1], bounds[1:]):
        if high <= low:
            continue
        count, width = high - low, int(lengths[high - 1])
        first, size = starts[low:high, None], lengths[low:high, None]
        steps = torch.arange(width, device=cu.device)[None, :]
        # Slots past a segment's end repeat its last token; causality hides them from the real queries.
        gather = torch.minimum(first + steps, first + size - 1).reshape(-1)
        real = steps < size
        slots = base + torch.arange(count * width, device=cu.device).view(count, width)
        scatter[(first + steps)[real]] = slots[real]
        buckets.append((gather, count, width))
        base += count * width
    return buckets, scatter


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout: float) -> torch.Tensor:
    width = q.shape[2]
    if width == 1:
        return v
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    future = torch.ones(width, width, dtype=torch.bool, device=q.device).triu(1)
    # The diagonal is always allowed, so no row is fully masked and softmax never sees only -inf.
    probabilities = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1, dtype=torch.float32)
    probabilities = F.dropout(probabilities, p=dropout) if dropout else probabilities
    return torch.matmul(probabilities.to(v.dtype), v)


def _dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
) -> tuple[torch.Tensor, None]:
    """Ordinary sdpa over a 4D mask (bool or additive), or causal when there is none (as transformers' sdpa)."""
    q_length, kv_length = query.shape[2], key.shape[2]
    if attention_mask is not None and attention_mask.dtype not in (torch.bool, query.dtype):
        attention_mask = attention_mask.to(query.dtype)
    is_causal = attention_mask is None and q_length > 1
    if is_causal and kv_length != q_length:
        # A prompt after cached tokens: sdpa's is_causal aligns top-left, this needs bottom-right.
        visible = torch.ones(q_length, kv_length, dtype=torch.bool, device=query.device)
        attention_mask = visible.tril(kv_length - q_length)
        is_causal = False
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal, scale=scaling
    )
    return output.transpose(1, 2).contiguous(), None


def _repeat_kv(states: torch.Tensor, heads: int) -> torch.Tensor:
    kv_heads = states.shape[1]
    return states if kv_heads == heads else states.repeat_interleave(heads // kv_heads, dim=1)
