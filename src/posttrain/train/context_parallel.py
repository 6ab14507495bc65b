"""Context parallelism: one sequence too long for one worker, split over the ranks of a process group.

Every rank holds a share of the sequence's tokens and runs the whole model on them: embeddings, norms, MLPs,
the head and the loss are per token, so they need nothing from the other ranks. Attention does: in every
layer each rank all-gathers the keys and values of the whole sequence and attends its own queries to them,
causally by global position (the all-gather form of context parallelism Llama 3 was trained with; ring
attention passes the same blocks around one neighbour at a time instead, overlapping compute and
communication — which matters on fast interconnects, not on gloo). The backward of the gather sums the
key/value gradients of every rank and keeps this rank's share.

Layout: the sequence is cut into ``2R`` equal chunks and rank r holds chunks r and ``2R-1-r`` (the "zigzag"
of Megatron's and torch's context parallel), so every rank has as much causal attention work as another.
The sequence is padded at the end to a multiple of ``2R`` tokens; padding sits after every real position, so
causality alone hides it from real queries, and it is never scored.

What one rank holds: the activations of ``T / R`` tokens per layer (what the backward keeps), and during one
layer's attention the full keys and values ``[kv_heads, T, head_dim]`` and the scores of its ``T / R`` queries
(the fused kernel keeps none of the scores for the backward).

    loss_sum, tokens = context_parallel_loss_sum(model, input_ids, labels, group)  # on every rank
    total = all_reduce_sum(tokens, group)
    (loss_sum / total).backward()
    all_reduce_gradients(model, group)      # the gradient one process computes on the whole sequence

The model's attention runs through ``posttrain_context_parallel`` while the call lasts (any transformers
causal LM that takes an attention implementation; no sliding windows, no soft-capping: a `ValueError`).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from posttrain.models import split_head
from posttrain.train.chunked import LOSS_CHUNK_TOKENS, chunked_head_stats

IMPLEMENTATION = "posttrain_context_parallel"


class _Shard(NamedTuple):
    group: Any
    query_positions: torch.Tensor  # [t] this rank's global positions
    key_positions: torch.Tensor  # [R * t] every rank's, in rank order (the order of the gathered keys)


_shard: contextvars.ContextVar[_Shard | None] = contextvars.ContextVar("posttrain_cp_shard", default=None)


def zigzag_positions(length: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's global positions of a sequence of `length` tokens (a multiple of ``2 * world_size``)."""
    if length % (2 * world_size):
        raise ValueError(f"zigzag_positions: length {length} is not a multiple of 2 * world_size ({2 * world_size})")
    chunk = length // (2 * world_size)
    first, second = rank, 2 * world_size - 1 - rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)])


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dimension (2) in rank order; backward: the summed gradient's own share."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.length = group, dist.get_rank(group), local.shape[2]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter; the sum, then this rank's share
        start = ctx.rank * ctx.length
        return grad[:, :, start : start + ctx.length].contiguous(), None


def context_parallel_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0,
                               scaling: float | None = None, sliding_window: int | None = None,
                               softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature (query ``[B, H, t, D]``, key/value ``[B, H_kv, t, D]`` of this rank's
    tokens; returns ``[B, t, H, D]``): attention over the whole sequence's keys, causal by global position."""
    shard = _shard.get()
    if shard is None:
        raise ValueError(f"{IMPLEMENTATION} attention runs only inside context_parallel_loss_sum")
    if sliding_window or softcap or kwargs.get("s_aux") is not None:
        raise ValueError(f"{IMPLEMENTATION}: sliding windows, soft-capping and sinks are not supported")
    heads = query.shape[1]
    keys, values = (_GatherSequence.apply(x, shard.group) for x in (key, value))
    if keys.shape[1] != heads:
        keys = keys.repeat_interleave(heads // keys.shape[1], dim=1)
        values = values.repeat_interleave(heads // values.shape[1], dim=1)
    visible = shard.key_positions[None, :] <= shard.query_positions[:, None]  # [t, T], True = attend
    output = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible.to(query.device),
                                            dropout_p=dropout, scale=scaling)
    return output.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # the attention builds its own from global positions


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface

        AttentionInterface.register(IMPLEMENTATION, context_parallel_attention)
        AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)
        _registered = True


@contextlib.contextmanager
def _attention(model: torch.nn.Module, shard: _Shard):
    _register()
    config = model.config
    before = config._attn_implementation
    token = _shard.set(shard)
    config._attn_implementation = IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation = before
        _shard.reset(token)


def context_parallel_loss_sum(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, group: Any = None,
                              *, chunk_tokens: int = LOSS_CHUNK_TOKENS) -> tuple[torch.Tensor, int]:
    """This rank's share of the summed token cross-entropy of one sequence, and its number of scored tokens.

    `input_ids` ``[T]`` (or ``[1, T]``) and `labels` (HF convention: the token itself where trained, -100
    elsewhere; label t is predicted from position t-1) are the whole sequence, the same on every rank.
    Summed over the ranks, the losses and counts are one process's `sft_loss_sum` on the sequence."""
    ids, labels = input_ids.reshape(-1), labels.reshape(-1)
    if ids.shape != labels.shape:
        raise ValueError(f"context_parallel_loss_sum: input_ids {tuple(ids.shape)} and labels {tuple(labels.shape)}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    length = ids.numel()
    padded = -(-length // (2 * world)) * 2 * world
    targets = torch.full((padded,), -100, dtype=torch.long, device=ids.device)
    targets[: length - 1] = labels[1:]  # position t predicts token t + 1
    ids = torch.cat([ids, ids.new_zeros(padded - length)])
    mine = zigzag_positions(padded, rank, world).to(ids.device)
    everyone = torch.cat([zigzag_positions(padded, r, world) for r in range(world)]).to(ids.device)
    parts = split_head(model)
    if parts is None:
        raise ValueError("context_parallel_loss_sum: the model's head cannot be split from its decoder")
    decoder, head = parts
    with _attention(model, _Shard(group, mine, everyone)):
        hidden = decoder(input_ids=ids[mine][None], position_ids=mine[None], use_cache=False).last_hidden_state[0]
    local_targets = targets[mine]
    scored = local_targets != -100
    stats = chunked_head_stats(model, head, hidden[scored], local_targets[scored], chunk_tokens=chunk_tokens)
    return -stats.logprobs.sum(), int(scored.sum())


def all_reduce_sum(value: float, group: Any = None) -> float:
    """`value` summed over the ranks of `group` (every rank gets the sum)."""
    tensor = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(tensor, group=group)
    return float(tensor)


def all_reduce_gradients(model: torch.nn.Module, group: Any = None) -> None:
    """Sum every parameter's gradient over the ranks (each rank backpropagated its share of the loss)."""
    for parameter in model.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad, group=group)
