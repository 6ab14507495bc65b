"""Log-probs (and entropies) of the scored tokens in chunks: no ``[tokens, vocab]`` logits tensor for a long
sequence, in the forward or the backward.

With a 32k vocabulary, the logits of one 8k-token sequence are 1 GiB in fp32, and a plain loss keeps more
than one such tensor alive for the backward (the bf16 head output under autocast, the fp32 copy, softmax's
output). Here the decoder runs once over the sequence, the head is applied to `chunk_tokens` scored
positions at a time, and each chunk is checkpointed (`torch.utils.checkpoint`, non-reentrant): the forward
keeps only the chunk's hidden states and its per-token results; the backward recomputes one chunk's logits
at a time. The price is one more head matmul per scored token (the head's forward runs twice); the memory of
the loss becomes ``chunk_tokens * vocab`` instead of ``tokens * vocab``. Scored tokens that fit in one chunk are
not checkpointed (nothing to save, the head runs once).

Per token, in fp32, as `train.forward` computes them unchunked (the same function, to float rounding):

    logit = softcap(head(h))                     (Gemma's final soft-cap, when the model has one)
    logprob = logit[target] / T - logsumexp(logit / T)
    entropy = logsumexp(z) - sum softmax(z) * z,   z = logit / T

A model whose head cannot be split off (`forward._splittable`) runs its own forward and is scored unchunked.

The SFT loss (`summed_cross_entropy`) skips the recomputation where the head is a plain bias-free linear layer
with no soft-cap (Llama and most families): its gradient with respect to the logits is known in the forward,
``softmax(logit) - onehot(target)`` times the loss's upstream gradient (one scalar), so each chunk's
gradients for the hidden states and the head weight are computed right away and the backward only scales
them (what Liger's fused linear cross-entropy does): three head matmuls per token, as an unchunked loss.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from posttrain.train.forward import (
    _after_head,
    _splittable,
    decoder_hidden,
    final_logit_softcap,
    selected_logits,
    target_logprobs,
)

# Scored tokens per chunk: 1,024 x 32k vocab is 128 MiB of fp32 logits; smaller chunks only add dispatch.
LOSS_CHUNK_TOKENS = 1024


class TokenStats(NamedTuple):
    logprobs: torch.Tensor  # [N] fp32, log p(target) under softmax(logits / temperature)
    entropy: torch.Tensor | None  # [N] fp32 entropy of softmax(logits / temperature), when asked for


def scored_token_stats(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    select: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int | None = LOSS_CHUNK_TOKENS,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **model_kwargs: Any,
) -> TokenStats:
    """Per scored token (where `select` [B, T-1] is True, row-major), the log-prob of `targets` [N] and,
    with `entropy`, the entropy; `chunk_tokens` None or 0 scores all tokens in one piece."""
    parts = _splittable(model)
    model_kwargs.setdefault("use_cache", False)
    if parts is None or not chunk_tokens:
        logits = selected_logits(model, input_ids, select, attention_mask=attention_mask, position_ids=position_ids,
                                 **model_kwargs)
        return _stats(logits, targets, temperature, entropy)
    decoder, head = parts
    hidden = decoder_hidden(decoder, input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            **model_kwargs)[:, :-1][select]
    return chunked_head_stats(model, head, hidden, targets, temperature=temperature, entropy=entropy,
                              chunk_tokens=chunk_tokens)


def chunked_head_stats(model: torch.nn.Module, head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                       *, temperature: float = 1.0, entropy: bool = False,
                       chunk_tokens: int = LOSS_CHUNK_TOKENS) -> TokenStats:
    """`TokenStats` of `hidden` [N, H] (the final hidden states at the scored positions) through `head`."""

    def piece(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        stats = _stats(_after_head(model, head(h).float()), t, temperature, entropy)
        return stats if entropy else stats[:1]

    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    # One chunk holds all the logits anyway: checkpointing it would only run the head twice (an RL batch of short
    # completions, a small vocabulary). Recompute only where it saves memory.
    grad = grad and hidden.shape[0] > chunk_tokens
    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        out = checkpoint(piece, h, t, use_reentrant=False) if grad else piece(h, t)  # (no checkpoint: autograd as usual)
        logprobs.append(out[0])
        if entropy:
            entropies.append(out[1])
    if not logprobs:  # nothing scored: empty results that still carry the graph's dtype and device
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return TokenStats(empty, empty if entropy else None)
    return TokenStats(torch.cat(logprobs), torch.cat(entropies) if entropy else None)


def summed_cross_entropy(model: torch.nn.Module, input_ids: torch.Tensor, select: torch.Tensor,
                         targets: torch.Tensor, *, chunk_tokens: int | None = LOSS_CHUNK_TOKENS,
                         **model_kwargs: Any) -> torch.Tensor:
    """Summed cross-entropy of `targets` at the scored positions (`select`), in chunks (see the module)."""
    parts = _splittable(model)
    if parts is None or not chunk_tokens:
        return -scored_token_stats(model, input_ids, select, targets, chunk_tokens=chunk_tokens,
                                   **model_kwargs).logprobs.sum()
    model_kwargs.setdefault("use_cache", False)
    hidden = decoder_hidden(parts[0], input_ids, **model_kwargs)[:, :-1][select]
    return head_cross_entropy(model, parts[1], hidden, targets, chunk_tokens=chunk_tokens)


def head_cross_entropy(model: torch.nn.Module, head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                       *, chunk_tokens: int = LOSS_CHUNK_TOKENS) -> torch.Tensor:
    """Summed cross-entropy of `targets` [N] from `hidden` [N, H] (the final hidden states at the scored
    positions) through `head`: fused where the head allows it, else checkpointed chunks (see the module)."""
    # (A sharded head -- FSDP2's DTensor parameters -- is gathered by its own forward hooks only: the chunks call it.)
    fused = (isinstance(head, torch.nn.Linear) and head.bias is None and final_logit_softcap(model) is None
             and torch.is_grad_enabled() and type(head.weight.data) is torch.Tensor)
    if not fused:
        return -chunked_head_stats(model, head, hidden, targets, chunk_tokens=chunk_tokens).logprobs.sum()
    device = hidden.device.type
    matmul_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    return _FusedHeadCrossEntropy.apply(hidden, head.weight, targets, chunk_tokens, matmul_dtype)


class _FusedHeadCrossEntropy(torch.autograd.Function):
    """sum_t -log softmax(h_t W^T)[target_t], its gradients computed chunk by chunk in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, matmul_dtype):
        with torch.autocast(hidden.device.type, enabled=False):
            # Autocast's numerics by hand: matmul operands and results in `matmul_dtype`, softmax in fp32.
            low = matmul_dtype or weight.dtype
            w = weight.detach().to(low)
            grad_hidden = torch.empty_like(hidden)
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, hidden.shape[0], chunk_tokens):
                h = hidden[start : start + chunk_tokens].detach().to(low)
                t = targets[start : start + chunk_tokens]
                logits = (h @ w.T).float()
                log_z = torch.logsumexp(logits, dim=-1)
                total += (log_z - logits.gather(-1, t[:, None]).squeeze(-1)).sum()
                grad_logits = torch.exp(logits - log_z[:, None])  # d(-log p_target) / d logits
                grad_logits[torch.arange(t.numel(), device=t.device), t] -= 1.0
                grad_logits = grad_logits.to(low)
                grad_hidden[start : start + chunk_tokens] = (grad_logits @ w).to(hidden.dtype)
                grad_weight += (grad_logits.T @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_output, (grad_weight * grad_output).to(ctx.weight_dtype), None, None, None


def _stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool) -> TokenStats:
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = target_logprobs(logits, targets)
    if not entropy:
        return TokenStats(logprobs, None)
    log_p = torch.log_softmax(logits, dim=-1)
    return TokenStats(logprobs, -(log_p.exp() * log_p).sum(-1))
