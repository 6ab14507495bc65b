"""Models: load any local Hugging Face causal LM, build the tiny built-in one, LoRA, atomic checkpoints, reward
models (`AutoModelForSequenceClassification` with one label), export, weight-only quantization (torchao),
vision-language models (`AutoModelForImageTextToText` + processor) and the built-in tiny VLM (`models.vision`).

    from posttrain.models import load_tokenizer, load_model, build_tiny_model, save_checkpoint
"""

from posttrain.models.attention import segments_from_positions, varlen_attention_forward, varlen_mask
from posttrain.models.compile_cache import (
    CompileMeter,
    CompileRecord,
    compile_cache_dir,
    compile_pays,
    compile_shape_key,
    prepare_compile,
    read_compile_record,
    use_compile_cache,
)
from posttrain.models.checkpoint import (
    capture_rng,
    latest_checkpoint,
    load_training_state,
    load_weights_from_checkpoint,
    restore_rng,
    save_checkpoint,
    save_model_dir,
)
from posttrain.models.load import (
    ModelError,
    attention_choice,
    autocast_dtype,
    load_model,
    load_tokenizer,
    resolve_device,
    set_attention,
)
from posttrain.models.kernels import prefer_prepacked, prepack, prepacked_linear
from posttrain.models.lora import apply_lora, count_adapted, is_lora, linear_layer_names, merged_copy, reference_mode
from posttrain.models.parts import attention_kernel, disable_dropout, split_head
from posttrain.models.rope import RopeScalingError, apply_rope_scaling, context_length, rope_parameters
from posttrain.models.reward import RewardModel, ScalarRewardModel, load_reward_model, save_reward_model
from posttrain.models.tiny import PRESETS, build_tiny_model, count_parameters, tiny_config
from posttrain.models.tokenizer import CHAT_TEMPLATE, END, PAD, train_tokenizer
from posttrain.models.tokenizer_match import check_same_tokenizer, tokenizer_differences
from posttrain.models.export import export_model
from posttrain.models.quantize import TARGETS as QUANTIZE_TARGETS, quantization_of, quantize_checkpoint
from posttrain.models.load import VARLEN
from posttrain.models.vision import (
    IMAGE_TOKEN,
    TEXT_KEYS as VISION_TEXT_KEYS,
    build_tiny_vlm,
    collate_vision,
    image_placeholder_ids,
    images_only_processor,
    load_processor,
    load_vision_model,
    load_vision_policy,
    multimodal_token_types,
    policy_processor,
    vision_chat_template,
    vision_inputs,
    vision_request,
    wants_vision,
)

__all__ = [
    "IMAGE_TOKEN",
    "VISION_TEXT_KEYS",
    "build_tiny_vlm",
    "collate_vision",
    "image_placeholder_ids",
    "images_only_processor",
    "load_processor",
    "load_vision_model",
    "load_vision_policy",
    "multimodal_token_types",
    "policy_processor",
    "vision_chat_template",
    "vision_inputs",
    "vision_request",
    "wants_vision",
    "CHAT_TEMPLATE",
    "END",
    "ModelError",
    "PAD",
    "PRESETS",
    "QUANTIZE_TARGETS",
    "RewardModel",
    "RopeScalingError",
    "ScalarRewardModel",
    "VARLEN",
    "apply_lora",
    "apply_rope_scaling",
    "attention_choice",
    "attention_kernel",
    "autocast_dtype",
    "build_tiny_model",
    "capture_rng",
    "check_same_tokenizer",
    "CompileMeter",
    "CompileRecord",
    "compile_cache_dir",
    "compile_pays",
    "compile_shape_key",
    "prepare_compile",
    "read_compile_record",
    "count_adapted",
    "context_length",
    "count_parameters",
    "disable_dropout",
    "use_compile_cache",
    "export_model",
    "is_lora",
    "latest_checkpoint",
    "linear_layer_names",
    "load_model",
    "load_reward_model",
    "load_tokenizer",
    "load_training_state",
    "load_weights_from_checkpoint",
    "merged_copy",
    "prefer_prepacked",
    "prepack",
    "prepacked_linear",
    "quantization_of",
    "quantize_checkpoint",
    "reference_mode",
    "resolve_device",
    "restore_rng",
    "rope_parameters",
    "save_checkpoint",
    "save_model_dir",
    "save_reward_model",
    "segments_from_positions",
    "set_attention",
    "split_head",
    "tiny_config",
    "tokenizer_differences",
    "train_tokenizer",
    "varlen_attention_forward",
    "varlen_mask",
]
