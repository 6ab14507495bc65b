"""LoRA through peft: wrap by a recipe switch, switch the adapter off for a reference, merge to save.

With LoRA the reference policy (DPO, KL in RL) is the base with the adapter disabled, so no second copy
of the model is kept in memory (`reference_mode`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import PreTrainedModel

from posttrain.config import LoraConfig


def apply_lora(model: PreTrainedModel, config: LoraConfig) -> PreTrainedModel:
    """Freeze `model` and add trainable low-rank adapters to `config.target_modules`."""
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [module for module in config.target_modules if module in present]
    if not targets:
        from posttrain.models.load import ModelError

        raise ModelError(
            f"model.lora.target_modules: none of {config.target_modules} exist in this model "
            f"(its linear layers include {sorted(n for n in present if 'proj' in n)[:8]})"
        )
    peft_config = PeftLoraConfig(
        r=config.r, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=targets,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_config)


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
