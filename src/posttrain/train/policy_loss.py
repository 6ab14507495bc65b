"""Policy-gradient losses for RL on sampled tokens (PPO / GRPO / DAPO / GSPO / Dr. GRPO family).

All functions work on the flat list of scored tokens of a batch: `logprobs[N]` (current policy, with
gradient), `old_logprobs[N]` (the policy the ratio is taken against), `advantages[N]` (the sequence's
advantage repeated on each of its tokens) and `seq_index[N]` (which of the `num_seqs` sequences a token
belongs to). Observation tokens of agentic episodes are never in this list.

Per token t of sequence i, with ratio r = exp(logp - old_logp):

    PPO (token level):   l_t = -min(r_t A_i, clip(r_t, 1 - eps_low, 1 + eps_high) A_i)
    clip-higher (DAPO):  eps_high > eps_low, so low-probability tokens can grow (keeps entropy up)
    dual clip:           for A_i < 0, l_t = min(l_t, -c A_i): a huge ratio cannot blow up the loss
    GSPO (sequence):     r_i = exp(mean_t(logp - old_logp)) replaces r_t, one clip decision per sequence;
                         written as sg[r_i] * exp(logp_t - sg[logp_t]) so the gradient is GSPO's
                         sequence-level gradient. With one-token sequences it equals PPO.

Aggregation of l over the batch:

    token_mean  sum_t l_t / #tokens                           (DAPO: long answers count per token)
    seq_mean    mean_i (sum_{t in i} l_t / |i|)               (GRPO paper: each sequence counts once)
    constant    sum_t l_t / (num_seqs * normalizer)           (Dr. GRPO: no length normalisation bias)

Truncated importance sampling (Yao et al., 2025): when `old_logprobs` are the trainer's own ("proximal")
log-probs, samples drawn by another numeric path (the inference engine) or an older policy are reweighted
by w_t = min(exp(proximal_t - behaviour_t), cap), detached.

The critic of PPO with GAE (`rl.learned.Critic`) regresses its values V on the targets G with PPO's clipped value loss:
V_clip = V_old + clip(V - V_old, -c, c), l_t = 1/2 max((V - G)^2, (V_clip - G)^2), so one update cannot move a
value further than c from the one the advantages were computed with (unless that brings it closer to G).

KL to a reference policy (optional) uses Schulman's estimators of KL(pi || ref) from samples of pi:
k1 = logp - ref, k2 = (logp - ref)^2 / 2, k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, >= 0).
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean", "constant"]
RatioLevel = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k2", "k3"]


def segment_mean(values: torch.Tensor, seq_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Mean of `values` within each sequence -> [num_seqs] (0 for a sequence with no tokens)."""
    sums = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(0, seq_index, values)
    counts = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(
        0, seq_index, torch.ones_like(values)
    )
    return sums / counts.clamp(min=1)


def aggregate(
    per_token: torch.Tensor,
    seq_index: torch.Tensor,
    num_seqs: int,
    mode: Aggregation,
    normalizer: float | None = None,
    *,
    total_tokens: int | None = None,
    total_seqs: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar by one of the aggregations above.

    With gradient accumulation, pass the whole optimizer batch's `total_tokens` / `total_seqs`, so the
    micro-batch losses sum to the loss of the full batch.
    """
    if per_token.numel() == 0:
        return per_token.sum()
    if mode == "token_mean":
        return per_token.sum() / (total_tokens or per_token.numel())
    if mode == "seq_mean":
        present = torch.zeros(num_seqs, dtype=torch.bool, device=per_token.device)
        present[seq_index] = True
        return segment_mean(per_token, seq_index, num_seqs)[present].sum() / (total_seqs or int(present.sum()))
    if mode == "constant":
        if not normalizer:
            raise ValueError("aggregation 'constant' needs a normalizer (e.g. the max new tokens)")
        return per_token.sum() / ((total_seqs or num_seqs) * normalizer)
    raise ValueError(f"unknown aggregation {mode!r}")


def policy_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    seq_index: torch.Tensor,
    num_seqs: int,
    level: RatioLevel,
) -> torch.Tensor:
    """Per-token importance ratio (token level) or each token's sequence-level ratio (GSPO form)."""
    log_ratio = logprobs - old_logprobs
    if level == "token":
        return torch.exp(log_ratio)
    sequence_log_ratio = segment_mean(log_ratio, seq_index, num_seqs)[seq_index]
    # Value: the sequence ratio; gradient: d/dθ of the sequence ratio spread over its tokens.
    return torch.exp(sequence_log_ratio.detach() + logprobs - logprobs.detach())


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    seq_index: torch.Tensor,
    num_seqs: int,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ratio_level: RatioLevel = "token",
    aggregation: Aggregation = "token_mean",
    normalizer: float | None = None,
    dual_clip: float | None = None,
    importance_weights: torch.Tensor | None = None,
    total_tokens: int | None = None,
    total_seqs: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate loss (to minimise) and its statistics."""
    per_token, stats = per_token_policy_loss(
        logprobs, old_logprobs, advantages, seq_index, num_seqs, clip_low=clip_low, clip_high=clip_high,
        ratio_level=ratio_level, dual_clip=dual_clip, importance_weights=importance_weights,
    )
    loss = aggregate(per_token, seq_index, num_seqs, aggregation, normalizer,
                     total_tokens=total_tokens, total_seqs=total_seqs)
    return loss, stats


def per_token_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    seq_index: torch.Tensor,
    num_seqs: int,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ratio_level: RatioLevel = "token",
    dual_clip: float | None = None,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate per token (before aggregation) and its statistics."""
    ratio = policy_ratio(logprobs, old_logprobs, seq_index, num_seqs, ratio_level)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    unclipped = -advantages * ratio
    clipped = -advantages * clipped_ratio
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * dual_clip), per_token)
    if importance_weights is not None:
        per_token = per_token * importance_weights.detach()
    with torch.no_grad():
        is_clipped = (clipped > unclipped) & (advantages != 0)
        stats = {
            "clip_fraction": _mean(is_clipped.float()),
            "ratio_mean": _mean(ratio),
            "ratio_max": float(ratio.max()) if ratio.numel() else 1.0,
            "ratio_min": float(ratio.min()) if ratio.numel() else 1.0,
        }
    return per_token, stats


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, targets: torch.Tensor,
                       clip: float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss per token (before aggregation; see the module docstring) and its statistics."""
    unclipped = (values - targets).pow(2)
    if clip is None:
        per_token, is_clipped = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (clipped_values - targets).pow(2)
        per_token = torch.maximum(unclipped, clipped)
        is_clipped = clipped.detach() > unclipped.detach()
    return 0.5 * per_token, {"value_clip_fraction": _mean(is_clipped.float())}


def truncated_importance_weights(
    proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """min(pi_proximal / pi_behaviour, cap), detached."""
    return torch.exp(proximal_logprobs.detach() - behaviour_logprobs).clamp(max=cap)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.pow(2)
    if estimator == "k3":
        # Clamp the exponent: a token the reference finds 1e-20 times less likely would overflow exp().
        return torch.exp((-log_ratio).clamp(max=20.0)) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-row entropy of softmax(logits) in nats, computed stably in fp32."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def logprob_gap_stats(trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor) -> dict[str, float]:
    """How far the engine's behaviour log-probs are from the trainer's for the same tokens.

    Reported every step: mean/max absolute difference, a k3 estimate of KL(behaviour || trainer) per token,
    and the effective sample size fraction of the importance weights trainer/behaviour (1 = identical).
    """
    if trainer_logprobs.numel() == 0:
        return {"gap_abs_mean": 0.0, "gap_abs_max": 0.0, "gap_kl": 0.0, "gap_ess": 1.0}
    with torch.no_grad():
        diff = trainer_logprobs.double() - behaviour_logprobs.double()
        weights = torch.exp(diff.clamp(-20, 20))
        ess = float(weights.sum() ** 2 / (weights.pow(2).sum() * weights.numel()))
        return {
            "gap_abs_mean": float(diff.abs().mean()),
            "gap_abs_max": float(diff.abs().max()),
            "gap_kl": float((torch.exp(diff.clamp(max=20)) - diff - 1).mean()),
            "gap_ess": ess,
        }


def _mean(values: torch.Tensor) -> float:
    return float(values.mean()) if values.numel() else 0.0
