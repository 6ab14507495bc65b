"""Forward passes that compute the output head only where a loss needs it.

A causal LM's head (hidden -> vocabulary) is the largest matmul of a small model with a real vocabulary,
and SFT/RL only score a fraction of the positions (assistant tokens, sampled tokens). So we run the
decoder once over the whole sequence and apply the head to the selected positions only. Logits are
upcast to fp32 before any softmax: bf16 logits lose the small differences that log-probabilities live in.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.models import split_head


def selected_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    select: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **model_kwargs: Any,
) -> torch.Tensor:
    """fp32 logits predicting token t+1 from position t, for every (b, t) where `select[b, t]` ([B, T-1]).

    Returns [N, vocab] in the row-major order of `select`'s True entries. `model_kwargs` go to the decoder
    (e.g. the `cu_seq_lens_*` of a packed batch for variable-length attention).
    """
    parts = split_head(model)
    model_kwargs.setdefault("use_cache", False)  # a KV cache would stop transformers keeping packed samples apart
    if parts is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       **model_kwargs).logits
        return logits[:, :-1][select].float()
    decoder, head = parts
    hidden = decoder(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **model_kwargs
    ).last_hidden_state
    return head(hidden[:, :-1][select]).float()


def target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(target) under log_softmax(logits / temperature), computed without materialising log_softmax."""
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
