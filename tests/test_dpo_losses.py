"""Preference losses against values worked out by hand on fixed per-sequence log-probs."""

import math

import pytest
import torch

from posttrain.config import DPOLossConfig
from posttrain.train.preference_losses import (
    bradley_terry_loss,
    dpo_loss,
    ipo_loss,
    preference_loss,
    simpo_loss,
)

# One pair: policy log-probs chosen -1, rejected -2; reference -1.5 for both.
# Log-ratios: chosen +0.5, rejected -0.5, difference 1.0.
PC, PR, RC, RR = (torch.tensor([v]) for v in (-1.0, -2.0, -1.5, -1.5))


def softplus(x: float) -> float:  # -log sigmoid(-x)
    return math.log(1.0 + math.exp(x))


def test_sigmoid_dpo():
    # h = beta * 1.0 = 0.5; loss = -log sigmoid(0.5) = log(1 + e^-0.5)
    assert dpo_loss(PC, PR, RC, RR, beta=0.5).item() == pytest.approx(softplus(-0.5), abs=1e-6)
    assert softplus(-0.5) == pytest.approx(0.474077, abs=1e-6)


def test_conservative_dpo():
    # 0.9 * log(1 + e^-0.5) + 0.1 * log(1 + e^0.5)
    expected = 0.9 * softplus(-0.5) + 0.1 * softplus(0.5)
    assert expected == pytest.approx(0.524077, abs=1e-6)
    assert dpo_loss(PC, PR, RC, RR, beta=0.5, label_smoothing=0.1).item() == pytest.approx(expected, abs=1e-6)


def test_ipo():
    # (1.0 - 1 / (2 * 0.25))^2 = (1 - 2)^2 = 1; with beta 0.5 the target is met exactly: 0
    assert ipo_loss(PC, PR, RC, RR, beta=0.25).item() == pytest.approx(1.0, abs=1e-6)
    assert ipo_loss(PC, PR, RC, RR, beta=0.5).item() == pytest.approx(0.0, abs=1e-6)


def test_simpo_length_normalised_and_not():
    chosen, rejected = torch.tensor([-3.0]), torch.tensor([-8.0])
    chosen_tokens, rejected_tokens = torch.tensor([3.0]), torch.tensor([4.0])
    # per token: -1 and -2; beta 2 * (1) - gamma 0.5 = 1.5
    got = simpo_loss(chosen, rejected, chosen_tokens, rejected_tokens, beta=2.0, gamma=0.5)
    assert got.item() == pytest.approx(softplus(-1.5), abs=1e-6)
    # summed: 2 * (5) - 0.5 = 9.5
    got = simpo_loss(chosen, rejected, chosen_tokens, rejected_tokens, beta=2.0, gamma=0.5, length_normalize=False)
    assert got.item() == pytest.approx(softplus(-9.5), rel=1e-5)


def test_bradley_terry():
    assert bradley_terry_loss(torch.tensor([1.0]), torch.tensor([0.0])).item() == pytest.approx(softplus(-1.0), abs=1e-6)
    assert bradley_terry_loss(torch.tensor([0.0]), torch.tensor([0.0])).item() == pytest.approx(math.log(2), abs=1e-6)


def test_dispatcher_rewards_and_length_normalisation():
    tokens_w, tokens_l = torch.tensor([2.0]), torch.tensor([4.0])
    out = preference_loss(DPOLossConfig(loss="sigmoid", beta=0.5), PC, PR, RC, RR, tokens_w, tokens_l)
    assert out.losses.item() == pytest.approx(softplus(-0.5), abs=1e-6)
    assert out.chosen_rewards.item() == pytest.approx(0.25) and out.rejected_rewards.item() == pytest.approx(-0.25)
    # IPO normalises by length by default: log-ratios 0.5 / 2 and -0.5 / 4 -> difference 0.375; beta 0.5 -> target 1
    out = preference_loss(DPOLossConfig(loss="ipo", beta=0.5), PC, PR, RC, RR, tokens_w, tokens_l)
    assert out.losses.item() == pytest.approx((0.375 - 1.0) ** 2, abs=1e-6)
    out = preference_loss(DPOLossConfig(loss="ipo", beta=0.5, length_normalize=False), PC, PR, RC, RR, tokens_w,
                          tokens_l)
    assert out.losses.item() == pytest.approx(0.0, abs=1e-6)
    out = preference_loss(DPOLossConfig(loss="cdpo", beta=0.5, label_smoothing=0.2), PC, PR, RC, RR, tokens_w,
                          tokens_l)
    assert out.losses.item() == pytest.approx(0.8 * softplus(-0.5) + 0.2 * softplus(0.5), abs=1e-6)
    # SimPO needs no reference; its reward is beta * mean log-prob
    out = preference_loss(DPOLossConfig(loss="simpo", beta=2.0, gamma=0.5), PC, PR, None, None, tokens_w, tokens_l)
    assert out.chosen_rewards.item() == pytest.approx(-1.0) and out.rejected_rewards.item() == pytest.approx(-1.0)
    assert out.losses.item() == pytest.approx(softplus(0.5), abs=1e-6)
    with pytest.raises(ValueError, match="needs reference"):
        preference_loss(DPOLossConfig(loss="sigmoid"), PC, PR, None, None, tokens_w, tokens_l)


def test_gradient_pushes_chosen_up_and_rejected_down():
    policy = torch.tensor([-1.0, -1.0], requires_grad=True)
    dpo_loss(policy[:1], policy[1:], RC, RR, beta=0.1).sum().backward()
    assert policy.grad[0] < 0 < policy.grad[1]  # minimising raises log p(chosen), lowers log p(rejected)
