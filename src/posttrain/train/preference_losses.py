"""Preference losses on per-sequence log-probabilities: the DPO family, SimPO, and Bradley–Terry.

Inputs are per-pair tensors: the summed log-probability of the chosen (w) and rejected (l) response under
the policy (pi) and the reference (ref), and, where a loss normalises by length, the responses' token
counts. Each function returns the per-pair loss; the caller averages. With the log-ratio
rho(y) = log pi(y|x) - log ref(y|x):

    sigmoid (DPO, Rafailov et al. 2023):   -log sigmoid(beta * (rho_w - rho_l))
    cdpo (conservative DPO, Mitchell 2023):  -(1 - eps) log sigmoid(h) - eps log sigmoid(-h),  h = beta (rho_w - rho_l)
                                           (the expected DPO loss when each label is flipped with probability eps)
    ipo (Azar et al. 2023):               (rho_w - rho_l - 1 / (2 beta))^2       (beta is the paper's tau)
    simpo (Meng et al. 2024):             -log sigmoid(beta * (log pi(w)/|w| - log pi(l)/|l|) - gamma)
    Bradley–Terry reward model:           -log sigmoid(r_w - r_l)

`preference_loss` applies a recipe's choice; with `length_normalize` every log-probability (policy and
reference) is first divided by its response's token count (SimPO's normalisation, and what makes the
squared IPO loss comparable across response lengths — the IPO paper states it on whole sequences).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain.config import DPOLossConfig


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Sigmoid DPO; with `label_smoothing` = eps > 0, conservative DPO (cDPO)."""
    h = beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))
    if label_smoothing == 0.0:
        return -F.logsigmoid(h)
    return -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)


def ipo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
) -> torch.Tensor:
    """IPO: regress the log-ratio difference onto 1 / (2 beta)."""
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    return (h - 1.0 / (2.0 * beta)) ** 2


def simpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    *,
    beta: float,
    gamma: float,
    length_normalize: bool = True,
) -> torch.Tensor:
    """SimPO: reference-free, on (by default) length-normalised log-probs, with target margin `gamma`."""
    if length_normalize:
        policy_chosen = policy_chosen / chosen_tokens.clamp(min=1)
        policy_rejected = policy_rejected / rejected_tokens.clamp(min=1)
    return -F.logsigmoid(beta * (policy_chosen - policy_rejected) - gamma)


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """-log P(chosen > rejected) under the Bradley–Terry model P = sigmoid(r_w - r_l)."""
    return -F.logsigmoid(chosen_scores - rejected_scores)


@dataclass
class PreferenceLoss:
    losses: torch.Tensor  # [pairs]
    chosen_rewards: torch.Tensor  # [pairs], detached: the implicit rewards the metrics report
    rejected_rewards: torch.Tensor


def preference_loss(
    config: DPOLossConfig,
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
) -> PreferenceLoss:
    """The recipe's loss per pair, and the implicit rewards: beta * rho (beta * mean log-prob for SimPO)."""
    if config.loss == "simpo":
        losses = simpo_loss(policy_chosen, policy_rejected, chosen_tokens, rejected_tokens, beta=config.beta,
                            gamma=config.gamma, length_normalize=config.normalizes_length)
        scale_w, scale_l = _length_scales(config, chosen_tokens, rejected_tokens)
        return PreferenceLoss(losses, (config.beta * policy_chosen * scale_w).detach(),
                              (config.beta * policy_rejected * scale_l).detach())
    if ref_chosen is None or ref_rejected is None:
        raise ValueError(f"loss {config.loss!r} needs reference log-probs")
    scale_w, scale_l = _length_scales(config, chosen_tokens, rejected_tokens)
    policy_chosen, ref_chosen = policy_chosen * scale_w, ref_chosen * scale_w
    policy_rejected, ref_rejected = policy_rejected * scale_l, ref_rejected * scale_l
    if config.loss == "ipo":
        losses = ipo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=config.beta)
    else:
        smoothing = config.label_smoothing if config.loss == "cdpo" else 0.0
        losses = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=config.beta,
                          label_smoothing=smoothing)
    return PreferenceLoss(losses, (config.beta * (policy_chosen - ref_chosen)).detach(),
                          (config.beta * (policy_rejected - ref_rejected)).detach())


def _length_scales(config: DPOLossConfig, chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor):
    if not config.normalizes_length:
        return 1.0, 1.0
    return 1.0 / chosen_tokens.clamp(min=1), 1.0 / rejected_tokens.clamp(min=1)


def sum_stats(**values: torch.Tensor) -> dict[str, float]:
    """Each tensor summed to a float (per-batch statistics the loop turns into per-pair means)."""
    return {key: float(value.detach().float().sum()) for key, value in values.items()}


def scored_pair_loss(config: DPOLossConfig, logprobs: torch.Tensor, counts: torch.Tensor,
                     reference: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-pair loss (with gradient) and summed statistics of a batch of P pairs scored by the policy:
    `logprobs` and `counts` [2P], chosen first, then rejected (summed log-probs, scored tokens); `reference`
    [P, 2] (chosen, rejected) or None.

    Statistics: loss, accuracy (implicit reward margin > 0), rewards and margin, summed log-probs of chosen and
    rejected, and preference (the policy itself gives chosen the higher log-prob, per token when the loss
    normalises by length).
    """
    pairs = logprobs.shape[0] // 2
    ref_chosen = ref_rejected = None
    if reference is not None:
        ref_chosen, ref_rejected = reference[:, 0].to(logprobs.device), reference[:, 1].to(logprobs.device)
    counts = counts.to(logprobs.dtype)
    result = preference_loss(config, logprobs[:pairs], logprobs[pairs:], ref_chosen, ref_rejected,
                             counts[:pairs], counts[pairs:])
    with torch.no_grad():
        margins = result.chosen_rewards - result.rejected_rewards
        scores = logprobs / counts.clamp(min=1) if config.normalizes_length else logprobs
        stats = sum_stats(loss=result.losses, accuracy=margins > 0, reward_chosen=result.chosen_rewards,
                          reward_rejected=result.rejected_rewards, reward_margin=margins,
                          logp_chosen=logprobs[:pairs], logp_rejected=logprobs[pairs:],
                          preference_accuracy=scores[:pairs] > scores[pairs:])
    return result.losses, stats
