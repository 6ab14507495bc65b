"""Forward passes that compute the output head only where a loss needs it.

A causal LM's head (hidden -> vocabulary) is the largest matmul of a small model with a real vocabulary,
and SFT/RL only score a fraction of the positions (assistant tokens, sampled tokens). So we run the
decoder once over the whole sequence and apply the head to the selected positions only. Logits are
upcast to fp32 before any softmax: bf16 logits lose the small differences that log-probabilities live in.

Whatever the model's own forward does after its head is done here too: the final-logit soft-cap
(Gemma 2/3: ``logits = cap * tanh(logits / cap)``, in fp32 here). A model that rescales its logits in a way
this module does not know (Cohere's ``logit_scale``, Granite's ``logits_scaling``) is not split: it runs its
own whole forward, slower but the same function. `check_forward_parity` (`train.parity`) compares this
forward with the model's at the start of a run.
"""

from __future__ import annotations

from typing import Any

import torch


def split_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder, head) of a Hugging Face causal LM (PEFT-wrapped or not), or None if it does not split."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        decoder, head = base.get_decoder(), base.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or head is None or decoder is base:
        return None
    return decoder, head


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
    parts = _splittable(model)
    model_kwargs.setdefault("use_cache", False)  # a KV cache would stop transformers keeping packed samples apart
    if parts is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       **model_kwargs).logits
        return logits[:, :-1][select].float()
    decoder, head = parts
    hidden = decoder(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **model_kwargs
    ).last_hidden_state
    return _after_head(model, head(hidden[:, :-1][select]).float())


# Logit rescalings some families apply after the head that `selected_logits` does not reproduce.
_UNKNOWN_HEAD_SCALINGS = ("logit_scale", "logits_scaling")


def _splittable(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _UNKNOWN_HEAD_SCALINGS):
        return None
    return split_head(model)


def final_logit_softcap(model: torch.nn.Module) -> float | None:
    """The model's final-logit soft-cap (Gemma 2/3), or None."""
    return getattr(getattr(model, "config", None), "final_logit_softcapping", None) or None


def _after_head(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    cap = final_logit_softcap(model)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(target) under log_softmax(logits / temperature), computed without materialising log_softmax."""
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
