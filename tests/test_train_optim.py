"""The optimizer every recipe builds: fused AdamW where torch has it, foreach otherwise, and saved states that
load into either without carrying the saver's kernel choice along."""

from __future__ import annotations

import copy

import torch

from posttrain.config import OptimConfig
from posttrain.models import build_tiny_model
from posttrain.train.optim import build_optimizer, load_optimizer_state


def steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, count: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        for parameter in model.parameters():
            parameter.grad = torch.randn(parameter.shape, generator=generator) * 1e-2
        optimizer.step()


def test_plain_cpu_parameters_take_the_fused_kernel_and_agree_with_foreach(tiny_tokenizer):
    config = OptimConfig(lr=1e-3, weight_decay=0.1)
    fused_model = build_tiny_model("tiny-1m", tiny_tokenizer, seed=0)
    foreach_model = build_tiny_model("tiny-1m", tiny_tokenizer, seed=0)
    fused = build_optimizer(fused_model, config)
    assert all(group["fused"] and not group["foreach"] for group in fused.param_groups)
    foreach = build_optimizer(foreach_model, config)
    for group in foreach.param_groups:
        group["fused"], group["foreach"] = None, True
    steps(fused_model, fused, 5)
    steps(foreach_model, foreach, 5)
    for a, b in zip(fused_model.parameters(), foreach_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the same update up to float rounding
    untouched = build_tiny_model("tiny-1m", tiny_tokenizer, seed=0)
    assert not torch.equal(next(fused_model.parameters()), next(untouched.parameters()))  # (it did update)


def test_a_saved_state_keeps_the_loading_optimizer_s_kernel_and_resumes_exactly(tiny_tokenizer):
    config = OptimConfig(lr=1e-3)
    model = build_tiny_model("tiny-1m", tiny_tokenizer, seed=0)
    optimizer = build_optimizer(model, config)
    steps(model, optimizer, 3)
    saved = copy.deepcopy(optimizer.state_dict())  # (state_dict() shares the live tensors)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    steps(model, optimizer, 2, seed=9)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    restored = build_tiny_model("tiny-1m", tiny_tokenizer, seed=0)
    restored.load_state_dict(weights)
    other = build_optimizer(restored, config)
    for group in other.param_groups:  # as a sharded run's optimizer would be
        group["fused"], group["foreach"] = None, True
    load_optimizer_state(other, saved)
    assert all(group["foreach"] and not group["fused"] for group in other.param_groups)
    steps(restored, other, 2, seed=9)
    for name, value in restored.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)
