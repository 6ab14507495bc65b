"""LoRA through peft: wrap by a recipe switch, switch the adapter off for a reference, merge to save.

With LoRA the reference policy (DPO, KL in RL) is the base with the adapter disabled, so no second copy
of the model is kept in memory (`reference_mode`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import PreTrainedModel

from posttrain.config import LoraConfig

log = logging.getLogger(__name__)


def apply_lora(model: PreTrainedModel, config: LoraConfig) -> PreTrainedModel:
    """Freeze `model` and add trainable low-rank adapters.

    With `target_modules` left unset, every linear layer of the model but its output head is adapted,
    whatever the family names them (Llama's q/k/v/o and gate/up/down projections, Phi-3's fused `qkv_proj`
    and `gate_up_proj`, GPT-NeoX's `query_key_value`, `dense`, `dense_h_to_4h`, `dense_4h_to_h`). A list
    that was set adapts the layers named in it that exist, and none existing is an error naming the real ones.
    """
    linear = linear_layer_names(model)
    if "target_modules" not in config.model_fields_set:
        targets = sorted(linear)
    else:
        targets = [module for module in config.target_modules if module in linear]
    if not targets:
        from posttrain.models.load import ModelError

        raise ModelError(
            f"model.lora.target_modules: none of {config.target_modules} is a linear layer of this model "
            f"(its linear layers: {sorted(linear)}); leave target_modules unset to adapt all of them"
        )
    peft_config = PeftLoraConfig(
        r=config.r, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=targets,
        task_type="CAUSAL_LM",
    )
    wrapped = get_peft_model(model, peft_config)
    log.info("LoRA: %d layers adapted (%s)", count_adapted(wrapped), ", ".join(targets))
    return wrapped


def linear_layer_names(model: torch.nn.Module) -> dict[str, int]:
    """The last name part of every linear layer but the output head, with how many layers carry it."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            suffix = name.rsplit(".", 1)[-1]
            counts[suffix] = counts.get(suffix, 0) + 1
    return counts


def count_adapted(model: torch.nn.Module) -> int:
    """How many layers of `model` carry a LoRA adapter."""
    return sum(1 for module in model.modules() if isinstance(module, LoraLayer))


def is_lora(model: object) -> bool:
    return isinstance(model, PeftModel)


@contextlib.contextmanager
def reference_mode(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Within the block, `model` computes the reference policy: the base with its adapter switched off."""
    if not is_lora(model):
        raise ValueError("reference_mode needs a LoRA model; without LoRA keep a separate reference model")
    with model.disable_adapter():
        yield model


def merged_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A plain model with the adapter folded into the base weights (the trained model keeps its adapter)."""
    import copy

    return copy.deepcopy(model).merge_and_unload()
