"""Advantages and policy losses against hand-computed values."""

import math

import pytest
import torch

from posttrain.rl.advantages import compute_advantages, normalize_per_domain
from posttrain.train.policy_loss import (
    aggregate,
    clipped_policy_loss,
    entropy_from_logits,
    kl_penalty,
    logprob_gap_stats,
    truncated_importance_weights,
)

GROUP = ["g"] * 4


@pytest.mark.parametrize(
    "estimator,expected",
    [
        ("grpo", [0.5, 0.5, 0.5, -1.5]),  # mean .75, unbiased std .5
        ("dr_grpo", [0.25, 0.25, 0.25, -0.75]),
        ("rloo", [1 / 3, 1 / 3, 1 / 3, -1.0]),  # 1 - mean(1, 1, 0)
        ("batch_norm", [0.5, 0.5, 0.5, -1.5]),
    ],
)
def test_advantages_of_a_1110_group(estimator, expected):
    advantages = compute_advantages([1, 1, 1, 0], GROUP, estimator)
    assert advantages.tolist() == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "batch_norm"])
def test_equal_rewards_carry_no_signal(estimator):
    advantages = compute_advantages([1, 1, 1, 1, 0, 0], ["a"] * 4 + ["b"] * 2, estimator)
    assert advantages.abs().max() < 1e-9


def test_groups_are_independent_and_unscaled_grpo_is_centred():
    advantages = compute_advantages([1, 0, 5, 3], ["a", "a", "b", "b"], "grpo", scale=False)
    assert advantages.tolist() == pytest.approx([0.5, -0.5, 1.0, -1.0])


def test_batch_norm_uses_the_batch_std_across_groups():
    advantages = compute_advantages([1, 0, 3, 1], ["a", "a", "b", "b"], "batch_norm")
    centred = torch.tensor([0.5, -0.5, 1.0, -1.0], dtype=torch.float64)
    assert advantages.tolist() == pytest.approx((centred / centred.std()).tolist(), abs=1e-5)


def test_per_domain_normalization():
    out = normalize_per_domain([0, 1, 10, 30, 5], ["a", "a", "b", "b", "c"])
    assert out[:2] == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], abs=1e-5)
    assert out[2:4] == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], abs=1e-5)
    assert out[4] == 0.0


def _tokens(probs, old_probs, advantages, seq_index):
    logp = torch.tensor(probs, dtype=torch.float64).log().requires_grad_()
    old = torch.tensor(old_probs, dtype=torch.float64).log()
    return logp, old, torch.tensor(advantages, dtype=torch.float64), torch.tensor(seq_index)


def test_clipped_loss_and_gradient_by_hand():
    # ratios: 0.6/0.4 = 1.5 (A=+1, clipped at 1.2), 0.3/0.5 = 0.6 (A=-1, clipped at 0.8), 0.5/0.5 = 1 (A=+2)
    logp, old, adv, seq = _tokens([0.6, 0.3, 0.5], [0.4, 0.5, 0.5], [1.0, -1.0, 2.0], [0, 0, 1])
    loss, stats = clipped_policy_loss(logp, old, adv, seq, 2, clip_low=0.2, clip_high=0.2)
    # per token: -min(1.5, 1.2) = -1.2 ; -min(-0.6, -0.8) = 0.8 ; -2
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.0) / 3)
    loss.backward()
    # Clipped tokens get no gradient; the unclipped one: d/dlogp (-A r) = -A r = -2 * 1, over 3 tokens.
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -2.0 / 3])
    assert stats["clip_fraction"] == pytest.approx(2 / 3)


def test_clip_higher_lets_positive_tokens_grow_further():
    logp, old, adv, seq = _tokens([0.6], [0.4], [1.0], [0])
    loss, _ = clipped_policy_loss(logp, old, adv, seq, 1, clip_low=0.2, clip_high=0.6)
    assert float(loss) == pytest.approx(-1.5)  # ratio 1.5 < 1.6: not clipped


def test_dual_clip_bounds_negative_advantages():
    logp, old, adv, seq = _tokens([0.9], [0.1], [-1.0], [0])  # ratio 9
    loss, _ = clipped_policy_loss(logp, old, adv, seq, 1, dual_clip=3.0)
    assert float(loss) == pytest.approx(3.0)
    loss.backward()
    assert float(logp.grad[0]) == 0.0


def test_gspo_equals_ppo_on_one_token_sequences():
    logp, old, adv, seq = _tokens([0.6, 0.2, 0.5], [0.4, 0.5, 0.45], [1.0, -1.0, 0.5], [0, 1, 2])
    ppo, _ = clipped_policy_loss(logp, old, adv, seq, 3, ratio_level="token", aggregation="seq_mean")
    (grad_ppo,) = torch.autograd.grad(ppo, logp)
    gspo, _ = clipped_policy_loss(logp, old, adv, seq, 3, ratio_level="sequence", aggregation="seq_mean")
    (grad_gspo,) = torch.autograd.grad(gspo, logp)
    assert float(ppo) == pytest.approx(float(gspo))
    assert grad_ppo.tolist() == pytest.approx(grad_gspo.tolist())


def test_gspo_uses_the_geometric_mean_ratio_of_the_sequence():
    logp, old, adv, seq = _tokens([0.5, 0.5], [0.25, 1.0], [1.0, 1.0], [0, 0])  # ratios 2 and 0.5
    loss, stats = clipped_policy_loss(logp, old, adv, seq, 1, ratio_level="sequence")
    assert stats["ratio_mean"] == pytest.approx(1.0)  # geometric mean of 2 and 0.5
    assert float(loss) == pytest.approx(-1.0)


def test_aggregations():
    per_token = torch.tensor([1.0, 3.0, 10.0])
    seq = torch.tensor([0, 0, 1])
    assert float(aggregate(per_token, seq, 2, "token_mean")) == pytest.approx(14 / 3)
    assert float(aggregate(per_token, seq, 2, "seq_mean")) == pytest.approx((2 + 10) / 2)
    assert float(aggregate(per_token, seq, 2, "constant", normalizer=4)) == pytest.approx(14 / 8)
    with pytest.raises(ValueError):
        aggregate(per_token, seq, 2, "constant")


def test_kl_estimators():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    assert float(kl_penalty(logp, ref, "k1")) == pytest.approx(math.log(2))
    assert float(kl_penalty(logp, ref, "k2")) == pytest.approx(0.5 * math.log(2) ** 2)
    assert float(kl_penalty(logp, ref, "k3")) == pytest.approx(0.5 + math.log(2) - 1)
    assert float(kl_penalty(ref, ref, "k3")) == 0.0


def test_truncated_importance_weights_cap():
    weights = truncated_importance_weights(torch.log(torch.tensor([0.9, 0.1])), torch.log(torch.tensor([0.1, 0.2])), 2.0)
    assert weights.tolist() == pytest.approx([2.0, 0.5])


def test_entropy_and_gap_stats():
    uniform = torch.zeros(2, 4)
    assert entropy_from_logits(uniform).tolist() == pytest.approx([math.log(4)] * 2)
    same = logprob_gap_stats(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -2.0]))
    assert same == {"gap_abs_mean": 0.0, "gap_abs_max": 0.0, "gap_kl": 0.0, "gap_ess": 1.0}
    apart = logprob_gap_stats(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0]))
    assert apart["gap_abs_max"] == pytest.approx(0.5) and apart["gap_ess"] < 1.0 and apart["gap_kl"] > 0
