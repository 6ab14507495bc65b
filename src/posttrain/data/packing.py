"""Epochs of rows (packed or not) and the batches a causal LM trains on, with no attention across samples.

`build_epoch` shuffles the samples by (seed, epoch) and, when packing, fills rows of `max_length` tokens by
best-fit decreasing (longest sample first into the open row it fills most tightly; rows end up >95% full on
typical SFT data), then shuffles the rows. A row carries, per token, its position inside its own sample
(restarting at 0) and a document id (0, 1, ... within the row).

`collate` pads rows to the longest in the batch (right padding) and returns HF-convention tensors. Labels are
the token where it is trained and -100 elsewhere, including the first token of every sample (in a packed row
the model would otherwise be taught to predict a sample's first token from the previous sample) and padding.

Three equivalent ways to keep attention inside each sample (see docs/data.md for their speed):

* `position_ids` alone (no `attention_mask`): transformers detects the restarts and builds the block mask.
* ``attention_mask=block_causal_mask(document_ids, dtype)``: an explicit 4D additive mask (sdpa and eager).
* ``cu_seq_lens_q/k`` + ``max_length_q/k`` (`model_inputs` adds them): variable-length attention, either
  flash-attention 2 on GPU or `posttrain.models.varlen_attention_forward`, which skips the masked blocks.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from posttrain.data.schema import DataError
from posttrain.data.tokenize import TokenizedSample

IGNORE_INDEX = -100


@dataclass
class Row:
    input_ids: list[int]
    loss_mask: list[int]
    position_ids: list[int]
    document_ids: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_documents(self) -> int:
        return self.document_ids[-1] + 1 if self.document_ids else 0


def build_epoch(
    tokenized: Sequence[TokenizedSample], *, epoch: int, seed: int, max_length: int, pack: bool
) -> list[Row]:
    """The rows of one epoch, deterministic in (seed, epoch)."""
    too_long = next((i for i, s in enumerate(tokenized) if len(s) > max_length), None)
    if too_long is not None:
        raise DataError(
            f"{tokenized[too_long].metadata.origin or f'sample {too_long}'} has {len(tokenized[too_long])} tokens, more than max_length={max_length}; "
            "tokenize with the same max_length"
        )
    rng = np.random.default_rng([seed % (1 << 64), epoch % (1 << 64), 0x9ACC])
    order = [int(i) for i in rng.permutation(len(tokenized))]
    lengths = [len(tokenized[i]) for i in order]
    bins = _best_fit_decreasing(lengths, max_length) if pack else [[i] for i in range(len(order))]
    rows = [_make_row([tokenized[order[i]] for i in members]) for members in bins]
    return [rows[int(i)] for i in rng.permutation(len(rows))]


def _best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bin packing: each item, longest first, goes to the open bin with the least room that still fits it.

    Bins are kept by free room in a sorted list, so each placement is a bisection: O(n log n) overall.
    Ties keep the incoming order (a shuffled order, hence random but deterministic).
    """
    by_length = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free_rooms: list[int] = []  # sorted free room of the open bins ...
    bins_by_room: dict[int, list[int]] = {}  # ... and which bins have that room
    for item in by_length:
        length = lengths[item]
        slot = bisect.bisect_left(free_rooms, length)
        if slot == len(free_rooms):
            bins.append([item])
            target, room = len(bins) - 1, capacity - length
        else:
            room = free_rooms[slot]
            target = bins_by_room[room].pop(0)
            if not bins_by_room[room]:
                free_rooms.pop(slot)
            bins[target].append(item)
            room -= length
        if room > 0:
            if not bins_by_room.get(room):
                bins_by_room[room] = []
                bisect.insort(free_rooms, room)
            bins_by_room[room].append(target)
    return bins


def _make_row(samples: list[TokenizedSample]) -> Row:
    input_ids: list[int] = []
    loss_mask: list[int] = []
    position_ids: list[int] = []
    document_ids: list[int] = []
    for document, sample in enumerate(samples):
        input_ids.extend(sample.input_ids)
        loss_mask.extend(sample.loss_mask)
        position_ids.extend(range(len(sample)))
        document_ids.extend([document] * len(sample))
    return Row(input_ids, loss_mask, position_ids, document_ids)


def collate(
    rows: Sequence[Row],
    pad_id: int,
    *,
    pad_to_multiple_of: int | None = None,
    block_mask_dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Pad `rows` (right padding, to the longest row or the next multiple of `pad_to_multiple_of`) into
    tensors ``[B, T]`` on `device`: input_ids, labels, position_ids, document_ids (-1 on padding); cu_seq_lens,
    the int32 segment boundaries of the flattened batch (see `cu_seq_lens`); num_tokens, the number of real
    (non-padding) tokens, an int. With `block_mask_dtype`, also attention_mask, the 4D `block_causal_mask`.
    Pass `model_inputs(batch)` to the model."""
    if not rows:
        raise DataError("collate: no rows")
    width = max(len(row) for row in rows)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.bool)
    position_ids = torch.zeros(shape, dtype=torch.long)
    document_ids = torch.full(shape, -1, dtype=torch.long)
    for b, row in enumerate(rows):
        n = len(row)
        input_ids[b, :n] = torch.tensor(row.input_ids)
        loss_mask[b, :n] = torch.tensor(row.loss_mask, dtype=torch.bool)
        position_ids[b, :n] = torch.tensor(row.position_ids)
        document_ids[b, :n] = torch.tensor(row.document_ids)
    # Never train on a sample's first token: in a packed row its "previous token" belongs to another sample.
    trained = loss_mask & (position_ids > 0)
    labels = torch.where(trained, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    batch: dict[str, Any] = {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "document_ids": document_ids,
        "cu_seq_lens": cu_seq_lens(document_ids),
    }
    if block_mask_dtype is not None:
        batch["attention_mask"] = block_causal_mask(document_ids, block_mask_dtype)
    batch = {key: value.to(device) for key, value in batch.items()}
    batch["num_tokens"] = sum(len(row) for row in rows)
    return batch


def cu_seq_lens(document_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative segment boundaries over the flattened ``[B*T]`` batch, flash-attention style: a segment is a
    sample, or a single padding token (so padding costs nothing and attends only to itself)."""
    batch, width = document_ids.shape
    flat = document_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    same_as_previous = flat[1:] == flat[:-1]
    starts[1:] = ~same_as_previous | (flat[1:] < 0)
    starts[::width] = True  # every row starts a segment
    boundaries = torch.nonzero(starts).flatten()
    end = torch.tensor([batch * width], dtype=boundaries.dtype)
    return torch.cat([boundaries, end]).to(torch.int32)


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments for a Hugging Face causal LM's forward on a collated batch.

    input_ids, position_ids, labels, and the variable-length keys (``cu_seq_lens_q/k``, ``max_length_q/k``)
    that flash-attention 2 and `varlen_attention_forward` use and other attention implementations ignore;
    attention_mask only when the batch has the 4D one; and ``use_cache=False``. Never a 2D padding mask or a
    cache: given either, transformers stops deriving the per-sample mask from `position_ids` and packed
    samples would see each other.
    """
    segments = batch["cu_seq_lens"]
    longest = int((segments[1:] - segments[:-1]).max())
    inputs: dict[str, Any] = {
        "input_ids": batch["input_ids"],
        "position_ids": batch["position_ids"],
        "labels": batch["labels"],
        "cu_seq_lens_q": segments,
        "cu_seq_lens_k": segments,
        "max_length_q": longest,
        "max_length_k": longest,
        # A KV cache (the default in eval mode) turns off transformers' packed-sequence detection.
        "use_cache": False,
    }
    if "attention_mask" in batch:
        inputs["attention_mask"] = batch["attention_mask"]
    return inputs


def block_causal_mask(document_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 4D mask ``[B, 1, T, T]`` letting token q see token k iff k <= q and both are in the same sample.

    Float dtypes give the additive form (0 to attend, the dtype's minimum to block) that transformers' sdpa and
    eager attention both take as is; ``torch.bool`` gives True-to-attend (sdpa only). A padding token sees only
    itself: a fully blocked row would turn softmax into NaN, which would then leak into the gradients.
    """
    width = document_ids.shape[-1]
    query_docs = document_ids[:, None, :, None]
    key_docs = document_ids[:, None, None, :]
    causal = torch.ones(width, width, dtype=torch.bool, device=document_ids.device).tril()
    allowed = (query_docs == key_docs) & (key_docs >= 0) & causal
    allowed |= torch.eye(width, dtype=torch.bool, device=document_ids.device)
    if dtype == torch.bool:
        return allowed
    mask = torch.zeros(allowed.shape, dtype=dtype, device=document_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
