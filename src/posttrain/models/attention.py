"""Variable-length attention for packed rows: each sample attends only to itself, and masked blocks cost nothing.

A packed batch ``[B, T]`` holds many samples per row. Attention with a block-diagonal 4D mask computes all
``T x T`` scores per row and throws most away; on CPU it is also where sdpa is slowest (measured in
docs/data.md). This kernel works on segments instead: the samples of the flattened ``B*T`` tokens, given as
flash-attention-style boundaries ``cu_seq_lens_q`` (`posttrain.data.cu_seq_lens`; every padding token is a
segment of its own) or, when there is none and no mask either, read off `position_ids` the way transformers
detects packing (a new segment wherever a position is not the previous one plus 1). It gathers the segments
into a few length buckets (sorted by length, padded to the bucket's longest), runs causal attention per
bucket, and scatters the outputs back:

    out[s] = softmax(cap(q_s k_s^T * scale) + causal + window) v_s      for every segment s

with the model's own attention features, as transformers passes them to every attention implementation:
``softcap`` (Gemma 2: ``cap(x) = softcap * tanh(x / softcap)``, applied before the mask, as the eager
kernel does) and ``sliding_window`` (Mistral, Qwen2, Gemma 2/3, Phi-3 layers: key k is visible from query q
only when ``q - window < k <= q``, transformers' `sliding_window_overlay`). Anything else the kernel cannot
compute (attention sinks, ``s_aux``) is a `ValueError`, never a silent difference.

Bucket padding sits after each segment's real tokens, so causality alone keeps real queries from seeing it.
On CPU the per-bucket attention is plain matmul + fp32 softmax (faster there than the fused sdpa kernel in
bf16) up to `LONG_SEGMENT` tokens, and the fused causal sdpa kernel from there (the matmul path's backward
keeps ``width^2`` probabilities per head: a long-context run would spend its memory there); on other devices
it is `scaled_dot_product_attention` with ``is_causal`` (a boolean mask with a
window; the matmul path with a soft-cap, which sdpa cannot apply).

It plugs into transformers (>= 5) as an attention implementation for causal decoders (Llama and the like,
sliding-window and soft-capped layers included). Given a 4D mask, or a KV cache longer than the query
(generation), it is ordinary attention over that mask, so one model trains packed and generates.
`varlen_mask` wraps transformers' mask builder so that no 4D mask is built when the caller gave no padding
mask (a packed training batch):

    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    AttentionInterface.register("posttrain_varlen", varlen_attention_forward)
    AttentionMaskInterface.register("posttrain_varlen", varlen_mask(sdpa_mask))
    model.set_attn_implementation("posttrain_varlen")
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

NUM_BUCKETS = 4
# From this many tokens a bucket runs torch's fused causal kernel on CPU too (memory linear in the length).
LONG_SEGMENT = 1024


class _Features(NamedTuple):
    """What the model's attention computes beyond plain causal softmax attention."""

    scale: float
    window: int | None  # sliding window: a query sees itself and the window - 1 keys before it
    softcap: float | None  # scores -> softcap * tanh(scores / softcap), before the mask


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
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention with transformers' signature: ``query [B, H, T, D]``, key/value ``[B, H_kv, S, D]``;
    returns ``([B, T, H, D], None)``."""
    if kwargs.get("s_aux") is not None:
        raise ValueError("posttrain_varlen attention cannot compute attention sinks (s_aux); use 'eager'")
    batch, heads, length, head_dim = query.shape
    key, value = _repeat_kv(key, heads), _repeat_kv(value, heads)
    features = _Features(scaling if scaling is not None else head_dim**-0.5, sliding_window or None, softcap or None)
    if key.shape[2] != length:  # queries after cached keys: generation
        return _dense_attention(query, key, value, attention_mask, dropout, features)
    if cu_seq_lens_q is None and attention_mask is None and position_ids is not None:
        cu_seq_lens_q = segments_from_positions(position_ids.expand(batch, -1))
    if cu_seq_lens_q is None:
        return _dense_attention(query, key, value, attention_mask, dropout, features)
    if int(cu_seq_lens_q[-1]) != batch * length:
        raise ValueError(f"cu_seq_lens_q covers {int(cu_seq_lens_q[-1])} tokens, the batch has {batch * length}")

    def flat(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [B*T, H, D]
        return x.transpose(1, 2).reshape(batch * length, heads, head_dim)

    q, k, v = flat(query), flat(key), flat(value)
    buckets, scatter = _plan(cu_seq_lens_q.to(torch.long))
    pieces = []
    for gather, count, width in buckets:
        shape = (count, width, heads, head_dim)
        q_b, k_b, v_b = (x.index_select(0, gather).view(shape).transpose(1, 2) for x in (q, k, v))
        out = _causal_attention(q_b, k_b, v_b, features, dropout)
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


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, features: _Features,
                      dropout: float) -> torch.Tensor:
    width = q.shape[2]
    if width == 1:
        return v
    visible = torch.ones(width, width, dtype=torch.bool, device=q.device).tril()
    if features.window is not None and features.window < width:
        visible = visible.triu(1 - features.window)
    plain = features.window is None or features.window >= width
    if features.softcap is None and plain and width >= LONG_SEGMENT and not dropout:
        # Long segments: the fused kernel keeps O(width) memory for the backward; the matmul path below keeps
        # the [heads, width, width] probabilities (1 GiB per layer for 4 heads at 8k tokens).
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=features.scale)
    if q.device.type != "cpu" and features.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if plain else visible, dropout_p=dropout,
                                              is_causal=plain, scale=features.scale)
    # The diagonal is always visible, so no row is fully masked and softmax never sees only -inf.
    return _matmul_attention(q, k, v, visible, features, dropout)


def _matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      features: _Features, dropout: float) -> torch.Tensor:
    """softmax(cap(q k^T * scale) + mask) v with an fp32 softmax, in the order of transformers' eager kernel;
    `mask` is boolean (True = visible) or additive."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * features.scale
    if features.softcap is not None:
        scores = torch.tanh(scores / features.softcap) * features.softcap
    if mask is not None and mask.dtype == torch.bool:
        # The dtype's minimum, not -inf: a fully masked row (left padding) softmaxes to finite garbage, not NaN.
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    elif mask is not None:
        scores = scores + mask.to(scores.dtype)
    probabilities = torch.softmax(scores, dim=-1, dtype=torch.float32)
    probabilities = F.dropout(probabilities, p=dropout) if dropout else probabilities
    return torch.matmul(probabilities.to(v.dtype), v)


def _dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    features: _Features,
) -> tuple[torch.Tensor, None]:
    """Attention over a 4D mask (bool or additive; transformers builds it with the layer's window), or causal
    (with the window) when there is none, aligned bottom-right when queries follow cached keys."""
    q_length, kv_length = query.shape[2], key.shape[2]
    plain = features.window is None and features.softcap is None
    if attention_mask is None and plain and q_length == kv_length:
        output = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=q_length > 1,
                                                scale=features.scale)
        return output.transpose(1, 2).contiguous(), None
    # sdpa's is_causal aligns top-left; queries after cached keys need bottom-right.
    offset = kv_length - q_length
    if attention_mask is None:
        attention_mask = torch.ones(q_length, kv_length, dtype=torch.bool, device=query.device).tril(offset)
    if features.window is not None:
        # Also over a mask the caller built: transformers takes a 4D mask as given, without the layer's window.
        window = torch.ones(q_length, kv_length, dtype=torch.bool, device=query.device).triu(
            offset - features.window + 1)
        if attention_mask.dtype == torch.bool:
            attention_mask = attention_mask & window
        else:
            attention_mask = attention_mask.masked_fill(~window, torch.finfo(attention_mask.dtype).min)
    if features.softcap is not None or (query.device.type == "cpu" and kv_length < LONG_SEGMENT):
        # sdpa cannot soft-cap; and on CPU its masked kernel is slower than matmul + fp32 softmax on short rows
        # (a padded RL batch, tiny-3m, bf16, forward + backward: CPU time ~0.8x). Long rows keep sdpa's memory.
        output = _matmul_attention(query, key, value, attention_mask, features, dropout)
        return output.transpose(1, 2).contiguous(), None
    if attention_mask.dtype not in (torch.bool, query.dtype):
        attention_mask = attention_mask.to(query.dtype)
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=features.scale
    )
    return output.transpose(1, 2).contiguous(), None


def _repeat_kv(states: torch.Tensor, heads: int) -> torch.Tensor:
    kv_heads = states.shape[1]
    return states if kv_heads == heads else states.repeat_interleave(heads // kv_heads, dim=1)
