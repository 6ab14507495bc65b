"""Optimizer and learning-rate schedule, the same for every recipe.

AdamW with decoupled weight decay applied only to matrices (not to norms, biases or 1-d parameters, the
usual practice since GPT-2), and a schedule of linear warmup then cosine / linear decay to
`min_lr_ratio * lr`, or constant.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from posttrain.config import OptimConfig


def build_optimizer(model: torch.nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (decay if parameter.ndim >= 2 else no_decay).append(parameter)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Fused (one kernel for the whole update) where torch has it for these tensors, else foreach (one kernel per
    # operation over a group) -- never the per-parameter Python loop. On tiny models the optimizer is a visible
    # share of a step: tiny-3m on 2 CPU cores, 6.2 ms foreach against 0.85 ms fused; the two agree to float
    # rounding. Sharded (DTensor) parameters take foreach.
    fused = _can_fuse(decay + no_decay)
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=config.lr, betas=config.betas, eps=config.eps,
        fused=fused or None, foreach=not fused,
    )


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a saved optimizer state, keeping this optimizer's own implementation (fused or foreach): a run
    resumed on another backend (sharded parameters take foreach) must not inherit the saver's kernel choice."""
    implementation = ("fused", "foreach")
    groups = [{**saved, **{key: current[key] for key in implementation if key in current}}
              for saved, current in zip(state["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({**state, "param_groups": groups})


def _can_fuse(parameters: list[torch.Tensor]) -> bool:
    devices = {"cpu", "cuda"}
    return bool(parameters) and all(
        type(p.data) is torch.Tensor and p.device.type in devices
        and p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in parameters
    )


def lr_factor(step: int, total_steps: int, config: OptimConfig) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based)."""
    if config.warmup_steps and step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant" or total_steps <= config.warmup_steps:
        return 1.0
    progress = min(1.0, (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps))
    floor = config.min_lr_ratio
    if config.schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, config))
