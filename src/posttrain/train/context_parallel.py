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
The sequence is padded at the end to a multiple of ``2R`` tokens; padding is in no sample, so no real query
sees it, and it is never scored.

Packed rows (`shard_batch` of a collated SFT batch ``[B, T]``) are cut the same way, the same columns of every
row on a rank: each sample keeps its own rotary positions (`position_ids`), and the mask lets a query see the
keys of its own sample at or before its column (`block_causal_mask`, by global column), so the samples of a
row stay apart as in one process's variable-length attention. The targets (each position's next token) are
taken before the cut, since a position's next token may sit on another rank. The sft recipe runs this with
``cluster.context_parallel: R`` (`train.sft`, `posttrain.distributed.sft`).

What one rank holds: the activations of ``T / R`` tokens per layer (what the backward keeps), and during one
layer's attention the full keys and values ``[kv_heads, T, head_dim]`` and the scores of its ``T / R`` queries
(the fused kernel keeps none of the scores for the backward).

    loss_sum, tokens = context_parallel_loss_sum(model, input_ids, labels, group)  # on every rank
    total = all_reduce_sum(tokens, group)
    (loss_sum / total).backward()
    all_reduce_gradients(model, group)      # the gradient one process computes on the whole sequence

The model's attention runs through ``posttrain_context_parallel`` while the call lasts (any transformers
causal LM that takes an attention implementation). Not supported, a `ContextParallelError` naming it
(`check_context_parallel`, before a run trains): soft-capped attention (Gemma 2), attention sinks, sliding
windows shorter than the rows, vision-language models and heads that cannot be split from the decoder.
The attention is swapped only during the forward; with activation checkpointing (`train.step.prepare_model`)
`recompute_context` puts it back for each layer recomputed in the backward.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from posttrain.train.chunked import LOSS_CHUNK_TOKENS, head_cross_entropy
from posttrain.train.forward import _splittable
from posttrain.types import PosttrainError

IMPLEMENTATION = "posttrain_context_parallel"


class ContextParallelError(PosttrainError, ValueError):
    """What context parallelism cannot run (an attention it does not implement, a model it cannot split)."""


class _Shard(NamedTuple):
    group: Any
    visible: torch.Tensor  # [B, 1, t, T] True where this rank's query may attend a key (keys in gathered order)
    config: Any  # the model's config, whose attention implementation is swapped while the shard is on


_shard: contextvars.ContextVar[_Shard | None] = contextvars.ContextVar("posttrain_cp_shard", default=None)


def zigzag_positions(length: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's global positions of a sequence of `length` tokens (a multiple of ``2 * world_size``)."""
    if length % (2 * world_size):
        raise ValueError(f"zigzag_positions: length {length} is not a multiple of 2 * world_size ({2 * world_size})")
    chunk = length // (2 * world_size)
    first, second = rank, 2 * world_size - 1 - rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)])


def shard_batch(batch: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """This rank's zigzag share of a collated batch (`posttrain.data.collate`: packed rows ``[B, T]`` with
    input_ids, labels, position_ids, document_ids): the same columns of every row.

    Returns input_ids and position_ids ``[B, t]`` (the rotary positions stay each sample's own), `targets`
    ``[B, t]`` (the token each position predicts, -100 where untrained: the labels shifted by one *before*
    the split, since a position's next token may sit on another rank), `visible` ``[B, 1, t, T]`` (key k of
    the gathered sequence is visible from query q iff both are in the same sample and k <= q by column; a
    padding query sees itself only, so no softmax row is empty), `num_tokens` (this rank's real tokens) and
    `trained_tokens` (its scored ones)."""
    ids, labels = batch["input_ids"], batch["labels"]
    rows, width = ids.shape
    padded = -(-width // (2 * world_size)) * 2 * world_size
    extra = padded - width

    def pad(tensor: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([tensor, tensor.new_full((rows, extra), value)], dim=1)

    targets = ids.new_full((rows, padded), -100)
    targets[:, : width - 1] = labels[:, 1:]  # position t predicts token t + 1
    documents = pad(batch["document_ids"], -1)
    mine = zigzag_positions(padded, rank, world_size).to(ids.device)
    everyone = torch.cat([zigzag_positions(padded, r, world_size) for r in range(world_size)]).to(ids.device)
    query_docs, key_docs = documents[:, mine], documents[:, everyone]
    causal = everyone[None, :] <= mine[:, None]  # [t, T]
    visible = (query_docs[:, :, None] == key_docs[:, None, :]) & (key_docs[:, None, :] >= 0) & causal
    visible |= everyone[None, :] == mine[:, None]
    local_targets = targets[:, mine]
    return {"input_ids": pad(ids, 0)[:, mine], "position_ids": pad(batch["position_ids"], 0)[:, mine],
            "targets": local_targets, "visible": visible[:, None], "num_tokens": int((query_docs >= 0).sum()),
            "trained_tokens": int((local_targets != -100).sum())}


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
    tokens; returns ``[B, t, H, D]``): attention over the whole sequence's keys, by the shard's mask."""
    shard = _shard.get()
    if shard is None:
        raise ContextParallelError(f"{IMPLEMENTATION} attention runs only inside a context-parallel loss")
    width = shard.visible.shape[-1]
    if softcap or kwargs.get("s_aux") is not None or (sliding_window and sliding_window < width):
        raise ContextParallelError(
            f"{IMPLEMENTATION}: soft-capped attention, attention sinks and sliding windows shorter than the "
            f"sequence ({sliding_window} < {width} tokens) are not supported")
    heads = query.shape[1]
    keys, values = (_GatherSequence.apply(x, shard.group) for x in (key, value))
    if keys.shape[1] != heads:
        keys = keys.repeat_interleave(heads // keys.shape[1], dim=1)
        values = values.repeat_interleave(heads // values.shape[1], dim=1)
    output = F.scaled_dot_product_attention(query, keys, values, attn_mask=shard.visible.to(query.device),
                                            dropout_p=dropout, scale=scaling)
    return output.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # the attention takes its mask from the shard


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface

        AttentionInterface.register(IMPLEMENTATION, context_parallel_attention)
        AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)
        _registered = True


@contextlib.contextmanager
def _attention(shard: _Shard):
    _register()
    before = shard.config._attn_implementation
    token = _shard.set(shard)
    shard.config._attn_implementation = IMPLEMENTATION
    try:
        yield
    finally:
        shard.config._attn_implementation = before
        _shard.reset(token)


def recompute_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """`torch.utils.checkpoint`'s ``context_fn`` (non-reentrant): a layer checkpointed inside a split forward is
    recomputed in the backward with the split attention and the shard it ran with, not the model's own
    attention (the forward's `_attention` has ended by then). Outside a split forward: nothing."""
    shard = _shard.get()
    return contextlib.nullcontext(), (_attention(shard) if shard is not None else contextlib.nullcontext())


def check_context_parallel(model: torch.nn.Module, row_length: int | None = None) -> None:
    """Raise `ContextParallelError` naming what this model has that context parallelism cannot run: a
    vision-language model, a head that cannot be split from the decoder (an unknown logit rescaling),
    soft-capped attention (Gemma 2), attention sinks, or sliding windows shorter than `row_length` (a
    window at least as long as the rows cuts nothing, so Mistral's 4,096 is fine for rows up to 4,096)."""
    config = getattr(model, "config", None)
    problems = []
    if getattr(config, "vision_config", None) is not None:
        problems.append("a vision-language model")
    elif _splittable(model) is None:
        problems.append("a head that cannot be split from its decoder")
    if getattr(config, "attn_logit_softcapping", None):
        problems.append(f"soft-capped attention (attn_logit_softcapping {config.attn_logit_softcapping})")
    window = getattr(config, "sliding_window", None)
    windowed = getattr(config, "use_sliding_window", True) is not False or any(
        kind == "sliding_attention" for kind in (getattr(config, "layer_types", None) or []))
    if window and windowed and (row_length is None or window < row_length):
        problems.append(f"sliding-window attention (window {window} < rows of {row_length} tokens)")
    if any("sink" in name for name, _ in model.named_parameters()):
        problems.append("attention sinks")
    if problems:
        kind = getattr(config, "model_type", type(model).__name__)
        raise ContextParallelError(
            f"context parallelism cannot run this model ({kind}): {'; '.join(problems)}. Train it without "
            "cluster.context_parallel (one process, or data parallelism)")


def context_parallel_sft_loss_sum(model: torch.nn.Module, shard: dict[str, Any], group: Any = None, *,
                                  chunk_tokens: int = LOSS_CHUNK_TOKENS) -> tuple[torch.Tensor, int]:
    """This rank's share of the summed token cross-entropy of a sharded batch (`shard_batch`) and its number
    of scored tokens. Summed over the ranks: one process's `sft_loss_sum` on the whole batch."""
    parts = _splittable(model)
    if parts is None:
        check_context_parallel(model)
        raise ContextParallelError("context parallelism: the model's head cannot be split from its decoder")
    decoder, head = parts
    with _attention(_Shard(group, shard["visible"], model.config)):
        hidden = decoder(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                         use_cache=False).last_hidden_state
    scored = shard["targets"] != -100
    summed = head_cross_entropy(model, head, hidden[scored], shard["targets"][scored], chunk_tokens=chunk_tokens)
    return summed, int(scored.sum())


def context_parallel_loss_sum(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, group: Any = None,
                              *, chunk_tokens: int = LOSS_CHUNK_TOKENS) -> tuple[torch.Tensor, int]:
    """This rank's share of the summed token cross-entropy of one sequence, and its number of scored tokens.

    `input_ids` ``[T]`` (or ``[1, T]``) and `labels` (HF convention: the token itself where trained, -100
    elsewhere; label t is predicted from position t-1) are the whole sequence, the same on every rank.
    Summed over the ranks, the losses and counts are one process's `sft_loss_sum` on the sequence."""
    ids, labels = input_ids.reshape(1, -1), labels.reshape(1, -1)
    if ids.shape != labels.shape:
        raise ValueError(f"context_parallel_loss_sum: input_ids {tuple(ids.shape)} and labels {tuple(labels.shape)}")
    length = ids.shape[1]
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(length, device=ids.device)[None],
             "document_ids": ids.new_zeros(1, length)}
    shard = shard_batch(batch, dist.get_rank(group), dist.get_world_size(group))
    return context_parallel_sft_loss_sum(model, shard, group, chunk_tokens=chunk_tokens)


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
