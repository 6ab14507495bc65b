"""Training losses. Each is a plain function of tensors, unit-tested on hand-computed values.

SFT: mean token cross-entropy over trained (assistant) tokens. With gradient accumulation the sum over a
micro-batch is divided by the number of trained tokens in the whole optimizer batch, so the gradient equals
that of one big batch (a per-micro-batch mean would weight short micro-batches up). The head and the
cross-entropy run in chunks of scored tokens (`train.chunked`): no [tokens, vocab] logits tensor is kept.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.data import model_inputs
from posttrain.train.chunked import LOSS_CHUNK_TOKENS, summed_cross_entropy


def sft_loss_sum(model: torch.nn.Module, batch: dict[str, Any],
                 chunk_tokens: int | None = LOSS_CHUNK_TOKENS) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over the trained tokens of a collated batch (`posttrain.data.collate`: HF labels,
    -100 = not trained; packed rows keep each sample to itself) and the number of those tokens."""
    inputs = model_inputs(batch)
    labels = inputs.pop("labels")
    select = labels[:, 1:] != -100
    targets = labels[:, 1:][select]
    summed = summed_cross_entropy(model, inputs.pop("input_ids"), select, targets, chunk_tokens=chunk_tokens, **inputs)
    return summed, int(targets.numel())
