"""In-place weight updates: a trainer's state dict copied into the engine's parameters, checked first.

Accepted names are the engine model's own ``state_dict`` names, optionally behind the wrappers a trainer adds:
``module.`` (DDP), ``_orig_mod.`` (torch.compile), ``base_model.model.`` (PEFT) and PEFT's ``.base_layer``
infix. Unmerged LoRA tensors (``lora_A``/``lora_B``...) are refused: merge first, e.g. with
`state_for_engine(peft_model)`, which folds the adapter into the base weights without copying the model.

Every tensor the model's state dict holds must be given (a tied weight once, under either name), every given
name must exist and every shape must match; all of that is checked before anything is copied, so a bad state
leaves the engine as it was.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")
_LORA = re.compile(r"\.(lora_[A-Za-z_]+|lora_magnitude_vector)\b")


def canonical_name(name: str) -> str:
    """`name` without the wrapper prefixes and PEFT's `.base_layer` infix."""
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    return name.replace(".base_layer.", ".")


def check_state(model: torch.nn.Module, state: Mapping[str, Any]) -> dict[torch.Tensor, torch.Tensor]:
    """Map every target tensor of `model` to its new value, or raise ValueError listing every problem."""
    targets = model.state_dict(keep_vars=True)
    by_name = {canonical_name(name): tensor for name, tensor in targets.items()}
    problems: list[str] = []
    lora = sorted(name for name in state if _LORA.search(name))
    if lora:
        problems.append(
            f"{len(lora)} unmerged LoRA tensors (e.g. {lora[0]!r}): push merged weights, e.g. "
            "posttrain.rollout.state_for_engine(peft_model)"
        )
    updates: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    unknown, mismatched = [], []
    for name, value in state.items():
        if _LORA.search(name):
            continue
        target = by_name.get(canonical_name(name))
        if target is None:
            unknown.append(name)
        elif not isinstance(value, torch.Tensor):
            mismatched.append(f"{name}: a {type(value).__name__}, not a tensor")
        elif tuple(value.shape) != tuple(target.shape):
            mismatched.append(f"{name}: shape {tuple(value.shape)}, the model has {tuple(target.shape)}")
        else:
            updates[id(target)] = (target, value)
    if unknown:
        problems.append(
            f"{len(unknown)} names the model does not have: {_few(unknown)} "
            f"(the model's names look like {_few(list(by_name))})"
        )
    if mismatched:
        problems.append(f"{len(mismatched)} shape/type mismatches: {'; '.join(mismatched[:5])}")
    # Tied weights are one tensor under two names: given under either, both are covered.
    missing = sorted(name for name, tensor in by_name.items() if id(tensor) not in updates)
    if missing:
        problems.append(f"{len(missing)} tensors of the model are missing from the state: {_few(missing)}")
    if problems:
        raise ValueError("; ".join(problems))
    return {target: value for target, value in updates.values()}


def copy_state(updates: dict[torch.Tensor, torch.Tensor]) -> int:
    """Copy in place (casting dtype and device as needed); returns the bytes written."""
    written = 0
    with torch.no_grad():
        for target, value in updates.items():
            target.copy_(value, non_blocking=True)
            written += target.numel() * target.element_size()
    if any(t.is_cuda for t in updates):
        torch.cuda.synchronize()
    return written


def state_for_engine(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights an engine should serve for `model`: its state dict, with a PEFT LoRA adapter merged in.

    For a PEFT model each LoRA layer's base weight becomes ``W + delta`` (peft's ``get_delta_weight`` for the
    active adapters), a ``modules_to_save`` layer contributes its trained copy, and every name loses the PEFT
    wrappers; the adapter tensors are left out. The trainer's model is neither modified nor copied (only the
    merged weights are new tensors).
    """
    state = model.state_dict()
    if not hasattr(model, "peft_config"):
        return {name: tensor.detach() for name, tensor in state.items()}
    adapter = getattr(model, "active_adapter", "default")
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if _LORA.search(name) or ".original_module." in name:
            continue
        tensor = tensor.detach()
        if name.endswith(".base_layer.weight"):
            layer = model.get_submodule(name[: -len(".base_layer.weight")])
            tensor = tensor + _lora_delta(layer, name)
        merged[canonical_name(name.replace(f".modules_to_save.{adapter}.", "."))] = tensor
    return merged


def _lora_delta(layer: torch.nn.Module, name: str) -> torch.Tensor | int:
    if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return 0
    delta: torch.Tensor | int = 0
    for adapter in layer.active_adapters:
        if adapter not in getattr(layer, "lora_A", {}):
            continue
        if getattr(layer, "use_dora", {}).get(adapter, False):
            raise ValueError(f"{name}: DoRA adapters are not supported; merge the model (merge_and_unload) first")
        delta = delta + layer.get_delta_weight(adapter).detach()
    return delta


def _few(names: list[str], count: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:count])
    return shown + (f" ... ({len(names)} in all)" if len(names) > count else "")
