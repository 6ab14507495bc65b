"""Load a model and tokenizer: any local Hugging Face causal LM directory, or the built-in tiny model.

`model.path` (and `model.tokenizer_path`) is a local directory or a Hugging Face hub id (``org/name``). A hub id
is fetched from the hub when it is reachable, or read from the local hub cache (``HF_HOME``) when the user has set
``HF_HUB_OFFLINE=1`` themselves; posttrain never sets it. A hub id that can be neither fetched nor found in the
cache is a one-line `ModelError` naming the id and the fix. A tokenizer without a chat template is an error that
says how to supply one (`model.chat_template`), since every stage renders chats.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from typing import Iterable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from posttrain.config import ModelConfig, RuntimeConfig
from posttrain.models.rope import apply_rope_scaling, context_length
from posttrain.models.tiny import build_tiny_model
from posttrain.models.tokenizer import train_tokenizer
from posttrain.types import PosttrainError

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZE_HINT = "pip install 'posttrain[quantize]' (or: pip install torchao)"


class ModelError(PosttrainError):
    """A model or tokenizer could not be loaded, or lacks something the recipe needs."""


def resolve_device(runtime: RuntimeConfig) -> torch.device:
    if runtime.device == "cuda" and not torch.cuda.is_available():
        raise ModelError("runtime.device is 'cuda' but torch sees no CUDA device (install a CUDA build of torch)")
    if runtime.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(runtime.device)


def autocast_dtype(runtime: RuntimeConfig, device: torch.device) -> torch.dtype | None:
    """The dtype to autocast matmuls to, or None for plain fp32."""
    if runtime.precision == "fp32":
        return None
    if runtime.precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    # On CPUs with native bf16 dot products (AVX512-BF16, AMX) bf16 matmuls run ~4x faster than fp32;
    # elsewhere they are emulated and slower, so stay in fp32.
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else None


def load_tokenizer(config: ModelConfig, corpus: Iterable[str] | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer at `tokenizer_path` / `path`, or the built-in one trained on `corpus`."""
    location = config.tokenizer_path or config.path
    if location is None:
        if corpus is None:
            raise ModelError("the built-in tokenizer is trained on the run's text: pass a corpus, or set model.path")
        tokenizer = train_tokenizer(corpus)
    else:
        key = "model.tokenizer_path" if config.tokenizer_path else "model.path"
        _require_dir_or_hub_id(location, key)
        try:
            tokenizer = AutoTokenizer.from_pretrained(location)
        except (OSError, ValueError) as error:
            raise _load_error(location, key, "could not load a tokenizer", error) from None
    if config.chat_template:
        template = Path(config.chat_template)
        tokenizer.chat_template = template.read_text() if template.is_file() else config.chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(
            f"{location}: the tokenizer has no chat template; set model.chat_template to a Jinja template "
            "(or a file holding one)"
        )
    if tokenizer.pad_token_id is None:
        # Padding is masked out everywhere, so any id works; eos is the conventional choice.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    config: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device | str = "cpu",
) -> PreTrainedModel:
    """The causal LM at `config.path`, or a fresh built-in tiny model sized for `tokenizer`, with
    `config.rope_scaling` written into its config before it is built (`posttrain.models.rope`)."""
    dtype = _DTYPES[config.dtype]
    if config.path is None:
        model = build_tiny_model(config.preset, tokenizer, seed=config.seed, rope_scaling=config.rope_scaling)
        model = model.to(dtype)
    else:
        _require_dir_or_hub_id(config.path, "model.path")
        try:
            hf_config = AutoConfig.from_pretrained(config.path)
        except (OSError, ValueError) as error:
            raise _load_error(config.path, "model.path", "not a Hugging Face model directory", error) from None
        _require_quantizer(config.path)
        apply_rope_scaling(hf_config, config.rope_scaling)
        try:
            model = AutoModelForCausalLM.from_pretrained(config.path, config=hf_config, dtype=dtype)
        except ValueError as error:
            if "Unrecognized configuration class" not in str(error):  # transformers: no causal-LM class for it
                kind = "could not load the model"
            elif hasattr(hf_config, "vision_config"):  # e.g. a LLaVA-style vision-language model
                kind = ("a vision-language model that loads only with its processor (model.vision: true where the "
                        "recipe takes it; `posttrain serve` serves text models)")
            else:
                kind = "not a causal language model"
            raise _load_error(config.path, "model.path", kind, error) from None
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        raise ModelError(
            f"model.path: the model has {model.get_input_embeddings().num_embeddings} embeddings but the "
            f"tokenizer has {len(tokenizer)} tokens; use the tokenizer the model was trained with"
        )
    if config.rope_scaling is not None:
        # The tokenizer's own cap (the built-in one says 4,096) must not cut what the extended model can take: the
        # episode loop and eval bound a context by it.
        extended = context_length(model.config)
        if extended and (getattr(tokenizer, "model_max_length", 0) or 0) < extended:
            tokenizer.model_max_length = extended
    set_attention(model, config.attn_implementation, torch.device(device))
    return model.to(device)


VARLEN = "posttrain_varlen"


def attention_choice(model: PreTrainedModel, requested: str, device: torch.device) -> tuple[str, str | None]:
    """The attention implementation for `requested` on `device`, and why "auto" chose it (None otherwise).

    "auto" is the variable-length kernel on CPU (`posttrain.models.attention`: ~1.7x the tokens/s of sdpa on
    packed rows here; it computes soft-capping and sliding windows) and sdpa elsewhere — unless the model
    does not support sdpa (Gemma 2: sdpa cannot soft-cap), which gets eager. An explicit choice is returned
    as asked (transformers refuses one the model does not support, see `set_attention`).
    """
    if requested != "auto":
        return requested, None
    if device.type == "cpu":
        return VARLEN, "posttrain's variable-length kernel on CPU"
    if not getattr(model, "_supports_sdpa", False):
        return "eager", f"{type(model).__name__} does not support sdpa"
    return "sdpa", None


def set_attention(model: PreTrainedModel, choice: str, device: torch.device) -> None:
    """Select the attention implementation (see `attention_choice`); the reason for an "auto" fallback is
    logged, so a run says at its start which kernel computes its attention."""
    choice, reason = attention_choice(model, choice, device)
    if reason is not None and choice != VARLEN:
        log.warning("model.attn_implementation auto: %s (%s)", choice, reason)
    if choice == VARLEN:
        _register_varlen()
    try:
        model.set_attn_implementation(choice)
    except (ValueError, ImportError) as error:
        raise ModelError(f"model.attn_implementation: '{choice}' is not usable with this model ({error})") from None


def _register_varlen() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    from posttrain.models.attention import varlen_attention_forward, varlen_mask

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, varlen_mask(sdpa_mask))


# A hub repository id: "name" or "org/name" of letters, digits, '-', '_', '.' (no path separators beyond one '/').
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def is_hub_id(location: str) -> bool:
    """Whether `location` reads as a hub id rather than a path (it is not a local directory, nor path-shaped)."""
    return not Path(location).exists() and not location.startswith((".", "~")) and bool(_HUB_ID.match(location))


def hub_offline() -> bool:
    """Whether the user asked for offline mode (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE set to a true value)."""
    return any(os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _require_quantizer(location: str) -> None:
    """A clear error, before transformers' own, when a quantized checkpoint's library is not installed."""
    config = Path(location) / "config.json"
    if not config.is_file():
        return
    method = (json.loads(config.read_text()).get("quantization_config") or {}).get("quant_method")
    if method != "torchao":
        return
    if importlib.util.find_spec("torchao") is None:
        raise ModelError(f"{location}: a torchao-quantized checkpoint (posttrain quantize); loading it needs "
                         f"torchao: {QUANTIZE_HINT}")


def _require_dir_or_hub_id(location: str, key: str) -> None:
    if Path(location).is_dir() or is_hub_id(location):
        return
    raise ModelError(f"{key}: '{location}' is not a local directory, nor a hub id (org/name)")


def _load_error(location: str, key: str, problem: str, error: Exception) -> ModelError:
    """One line for a load that failed: for a hub id, whether the hub was off or unreachable, and the fix."""
    if Path(location).is_dir():
        return ModelError(f"{location}: {problem} ({_first_line(error)})")
    if hub_offline():
        return ModelError(f"{key}: '{location}' is no local directory, and as a hub id it is not in the local hub cache "
                          "(HF_HOME) while HF_HUB_OFFLINE is set: "
                          f"download it first (`hf download {location}`), unset HF_HUB_OFFLINE, or set {key} "
                          "to a local directory")
    return ModelError(f"{key}: could not fetch '{location}' from the Hugging Face hub ({_first_line(error)}): "
                      f"check the id and the network, or set {key} to a local directory")


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__
