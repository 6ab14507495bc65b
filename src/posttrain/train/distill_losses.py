"""Distillation losses: how far the student's next-token distribution is from the teacher's, per scored token.

Every function takes the logits of the scored positions only, ``[N, V]`` for teacher and student (the recipe
selects completion / assistant tokens before calling), and returns the per-token divergence ``[N]``; the recipe
sums and normalizes it like the SFT loss. With temperature τ both distributions are ``softmax(z / τ)``:

    p_T = softmax(z_T / τ),  p_S = softmax(z_S / τ)

    forward KL   KL(p_T ‖ p_S) = Σ_v p_T(v) (log p_T(v) - log p_S(v))
                 Hinton et al. (2015); mean-seeking: the student spreads over everything the teacher allows.
    reverse KL   KL(p_S ‖ p_T) = Σ_v p_S(v) (log p_S(v) - log p_T(v))
                 mode-seeking (MiniLLM, Gu et al. 2024): the student commits to the teacher's likeliest tokens.
    JSD(β)       β KL(p_T ‖ M) + (1 - β) KL(p_S ‖ M),   M = β p_T + (1 - β) p_S
                 the generalized Jensen-Shannon divergence of GKD (Agarwal et al., 2024), with their β.

The β convention (the GKD paper's and TRL's `generalized_jsd_loss`): to first order in β,
JSD(β) = β · KL(p_T ‖ p_S) + O(β²), and near β = 1 JSD(β) = (1 - β) · KL(p_S ‖ p_T) + O((1 - β)²); so small β
behaves like forward KL and β near 1 like reverse KL, while the value itself goes to 0 at both ends (M becomes
one of the two distributions). At exactly β = 0 and β = 1 `generalized_jsd` therefore returns the forward and
the reverse KL themselves, as GKD defines the endpoints; β = 0.5 is the ordinary (symmetric) JSD.

Temperature: the divergence is multiplied by τ² (Hinton et al.), so the gradient's scale does not shrink as τ
grows and one learning rate serves every temperature; at τ = 1 nothing changes. The teacher's logits are
constants (no gradient flows into the teacher).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(p_T ‖ p_S) per row of ``[N, V]`` logits, times τ²."""
    student, teacher = _log_probs(student_logits, teacher_logits, temperature)
    return _kl(teacher, student) * temperature**2


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(p_S ‖ p_T) per row of ``[N, V]`` logits, times τ²."""
    student, teacher = _log_probs(student_logits, teacher_logits, temperature)
    return _kl(student, teacher) * temperature**2


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 0.5,
                    temperature: float = 1.0) -> torch.Tensor:
    """GKD's JSD(β) per row (see the module docstring for the β convention), times τ²."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta must be in [0, 1], got {beta}")
    student, teacher = _log_probs(student_logits, teacher_logits, temperature)
    if beta == 0.0:
        return _kl(teacher, student) * temperature**2
    if beta == 1.0:
        return _kl(student, teacher) * temperature**2
    # log M = logsumexp(log β + log p_T, log(1-β) + log p_S): in log space, so tiny probabilities keep their digits.
    mixture = torch.logsumexp(torch.stack([teacher + math.log(beta), student + math.log1p(-beta)]), dim=0)
    return (beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)) * temperature**2


def token_divergence(kind: str, student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, beta: float = 0.5,
                     temperature: float = 1.0) -> torch.Tensor:
    """The recipe's `distill.loss` by name: ``forward_kl``, ``reverse_kl`` or ``jsd``; per token ``[N]``."""
    if kind == "forward_kl":
        return forward_kl(student_logits, teacher_logits, temperature)
    if kind == "reverse_kl":
        return reverse_kl(student_logits, teacher_logits, temperature)
    if kind == "jsd":
        return generalized_jsd(student_logits, teacher_logits, beta, temperature)
    raise ValueError(f"distill.loss: unknown divergence '{kind}' (forward_kl, reverse_kl, jsd)")


def _log_probs(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float):
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"distillation: student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape")
    if temperature <= 0:
        raise ValueError(f"distillation: temperature must be > 0, got {temperature}")
    # fp32 softmax: in bf16 the small probabilities the KL weighs would round to zero.
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    return student, teacher


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per row from log-probabilities; 0 · log 0 counts as 0 (a token p never gives costs nothing)."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)
