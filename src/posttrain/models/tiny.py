"""The built-in tiny models: Llama architecture, ~1M to ~30M parameters, built from scratch locally.

They exist so every stage runs end to end on a laptop CPU in minutes. A preset fixes the shape; the vocabulary
comes from the tokenizer it is built with (see `posttrain.models.tokenizer`). The result is an ordinary
`LlamaForCausalLM`, saved and loaded like any Hugging Face model.

Parameter counts below are for a 512-token vocabulary (untied embeddings add 2 * vocab * hidden).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from posttrain.config import RopeScalingConfig
from posttrain.models.rope import apply_rope_scaling


@dataclass(frozen=True)
class TinyPreset:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int = 1024


PRESETS: dict[str, TinyPreset] = {
    "tiny-1m": TinyPreset(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384),  # ~1.0M
    "tiny-3m": TinyPreset(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=512),  # ~2.9M
    "tiny-10m": TinyPreset(hidden_size=384, num_layers=6, num_heads=6, intermediate_size=1024),  # ~11M
    "tiny-30m": TinyPreset(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1536),  # ~28M
}


def tiny_config(preset: str, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    shape = PRESETS[preset]
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        max_position_embeddings=shape.max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def build_tiny_model(preset: str, tokenizer: PreTrainedTokenizerBase, seed: int = 0,
                     rope_scaling: RopeScalingConfig | None = None) -> LlamaForCausalLM:
    """A freshly initialised tiny Llama whose vocabulary matches `tokenizer` (its rotary embedding scaled by
    `rope_scaling`, its context extended from the preset's 1,024 positions)."""
    config = apply_rope_scaling(tiny_config(preset, tokenizer), rope_scaling)
    # Initialise under a private generator state so building a model never perturbs the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
