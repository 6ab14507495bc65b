"""Scoring a group's completions behind one copy of their prompt (`train.shared_prefix`, opt-in).

An RL group is `G` completions of one prompt. The padded layout runs the prompt `G` times, once in each
sequence's row. Here a row holds one copy of a prompt followed by the continuations of its sequences (up to
`ROW_FACTOR` times the longest sequence; more go behind another copy of the prompt in another row), with positions
that restart after the prompt for every continuation and a mask that lets a continuation's tokens see the prompt
and the earlier tokens of their own continuation only. Every scored token then sees exactly the
tokens it saw in its own row, at the same positions, so the log-probs are the padded layout's up to float
rounding (tests/test_shared_prefix.py), for ~1/G of the prompt's tokens: on the demo's code prompts (~90 tokens,
answers ~40) about 2.5x fewer tokens through the decoder.

Only for a model whose attention is the plain causal kind that a 4D mask describes (`shared_prefix_unsupported`
says why not otherwise): transformers passes a 4D mask through as is, so a sliding window, a bidirectional image
span or a recurrent layer would be silently dropped, and only families checked against their padded forward
(`FAMILIES`). The prompt of a sequence is everything before its first
scored token, so multi-turn trajectories (tool observations between scored turns) share their first prompt and
keep the rest as their own continuation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from posttrain.models import VARLEN
from posttrain.train.chunked import TokenStats, chunked_head_stats
from posttrain.train.forward import _splittable, decoder_hidden

# posttrain's variable-length kernel (what `attn_implementation: auto` runs on CPU) takes a given 4D mask through
# its dense path (`posttrain.models.attention`), as sdpa and eager do
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", VARLEN)


# Families whose layout was checked against their padded forward (tests/test_shared_prefix.py): rotary positions
# from position_ids, attention masked by the 4D mask alone.
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "olmo2", "gpt_neox")


def shared_prefix_unsupported(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run the shared-prefix layout, or None when it can."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in FAMILIES:
        return f"its family {getattr(config, 'model_type', None)!r} is not one checked for it ({', '.join(FAMILIES)})"
    if _splittable(model) is None:
        return "its head cannot be run apart from its decoder (a vision-language model, or a rescaled head)"
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        return f"its attention implementation is {implementation!r} (the layout needs one of: " \
               f"{', '.join(ATTENTION_IMPLEMENTATIONS)})"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        return f"it has layers of kinds {sorted(layer_types)} (a 4D mask describes full causal attention only)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "it uses a sliding attention window"
    return None


# A row's attention is dense over the whole row (prompt and every continuation in it): a row is at most this many
# times the longest sequence, and the layout is only for sequences up to MAX_SEQUENCE tokens; longer batches keep
# the padded layout (causal attention without a mask), whose attention grows with each sequence alone.
ROW_FACTOR = 4
MAX_SEQUENCE = 1024


@dataclass(frozen=True)
class SharedPrefixBatch:
    """The layout of one micro-batch: `input_ids` and `position_ids` [R, L], `mask` [R, 1, L, L] (True: may
    attend), and for every scored token in the padded layout's order (sequence by sequence, position by
    position) the row and column of the hidden state that predicts it."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    tokens: int  # tokens through the decoder: rows x the longest row


def prompt_end(token_ids: Sequence[int], loss_mask: Sequence[int]) -> int:
    """Where a sequence's prompt ends: its first scored token (never the first token), or its end."""
    return next((t for t in range(1, len(token_ids)) if loss_mask[t]), len(token_ids))


def shared_prefix_batch(token_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]], pad_id: int,
                        device: torch.device | str) -> SharedPrefixBatch | None:
    """The layout of sequences `token_ids`, whose tokens with `loss_masks` 1 are scored (never the first); None
    when no two of them share a prompt (the padded layout is then the same rows without a mask)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    starts = []
    for index, (ids, mask) in enumerate(zip(token_ids, loss_masks)):
        first = prompt_end(ids, mask)
        starts.append(first)
        groups.setdefault(tuple(ids[:first]), []).append(index)
    if len(groups) == len(token_ids):
        return None
    limit = ROW_FACTOR * max(len(ids) for ids in token_ids)
    layouts = []  # per row: its ids, positions, segment of each column, and per sequence the column it starts at
    for prompt, members in groups.items():
        row = None
        for index in members:
            tail = list(token_ids[index][len(prompt):])
            if row is None or len(row[0]) + len(tail) > limit:  # a full row: the next one copies the prompt again
                row = (list(prompt), list(range(len(prompt))), [0] * len(prompt), {})
                layouts.append(row)
            ids, positions, segments, offsets = row
            offsets[index] = len(ids)
            segments += [len(offsets)] * len(tail)
            ids += tail
            positions += range(len(prompt), len(prompt) + len(tail))
    width = max(len(ids) for ids, _, _, _ in layouts)
    input_ids = torch.full((len(layouts), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(layouts), width), dtype=torch.long)
    segment_ids = torch.full((len(layouts), width), -1, dtype=torch.long)
    where: dict[int, tuple[int, int]] = {}
    for row, (ids, positions, segments, offsets) in enumerate(layouts):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        position_ids[row, : len(ids)] = torch.tensor(positions)
        segment_ids[row, : len(ids)] = torch.tensor(segments)
        for index, offset in offsets.items():
            where[index] = (row, offset)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    query, key = segment_ids.unsqueeze(2), segment_ids.unsqueeze(1)
    mask = causal & (key >= 0) & ((key == 0) | (key == query))
    mask |= torch.eye(width, dtype=torch.bool)  # a padding column attends to itself: no row without a key
    rows, columns = [], []
    for index, (ids, loss_mask) in enumerate(zip(token_ids, loss_masks)):
        row, offset = where[index]
        prompt = starts[index]
        for t in range(1, len(ids)):
            if loss_mask[t]:  # token t is predicted at position t - 1: the prompt's last, or in the continuation
                rows.append(row)
                columns.append(t - 1 if t - 1 < prompt else offset + (t - 1 - prompt))
    return SharedPrefixBatch(
        input_ids=input_ids.to(device), position_ids=position_ids.to(device), mask=mask.unsqueeze(1).to(device),
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        columns=torch.tensor(columns, dtype=torch.long, device=device),
        tokens=len(layouts) * width)


def shared_prefix_token_stats(model: torch.nn.Module, batch: SharedPrefixBatch, targets: torch.Tensor, *,
                              temperature: float = 1.0, entropy: bool = False) -> TokenStats:
    """`scored_token_stats` of the sequences laid out in `batch`: log-prob (and entropy) of `targets`, the scored
    tokens in the padded layout's order."""
    decoder, head = _splittable(model)
    mask = batch.mask
    if getattr(model.config, "_attn_implementation", None) == "eager":  # eager attention adds its mask
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    hidden = decoder_hidden(decoder, batch.input_ids, attention_mask=mask, position_ids=batch.position_ids,
                            use_cache=False)
    return chunked_head_stats(model, head, hidden[batch.rows, batch.columns], targets, temperature=temperature,
                              entropy=entropy)
