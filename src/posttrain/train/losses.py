"""Training losses. Each is a plain function of tensors, unit-tested on hand-computed values.

SFT: mean token cross-entropy over trained (assistant) tokens. With gradient accumulation the sum over a
micro-batch is divided by the number of trained tokens in the whole optimizer batch, so the gradient equals
that of one big batch (a per-micro-batch mean would weight short micro-batches up).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.train.forward import selected_logits


def sft_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over the trained tokens of `batch` (HF labels, -100 = not trained) and their count."""
    labels = batch["labels"]
    select = labels[:, 1:] != -100
    logits = selected_logits(
        model,
        batch["input_ids"],
        select,
        attention_mask=batch.get("attention_mask"),
        position_ids=batch.get("position_ids"),
    )
    targets = labels[:, 1:][select]
    return F.cross_entropy(logits, targets, reduction="sum"), int(targets.numel())
