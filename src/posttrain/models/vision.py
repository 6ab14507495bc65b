"""Vision-language models: any Hugging Face image-text-to-text model with its processor, and a built-in tiny one.

`load_vision_model(path)` loads a local directory or hub id with `AutoModelForImageTextToText` and `AutoProcessor`
(LLaVA, Gemma 3, Qwen2-VL, Idefics3 ... whatever the installed transformers maps). `vision_inputs` turns a chat
with images (`posttrain.data.VisionSample`'s shape: text and ``{"type": "image"}`` parts plus the images) into the
model's inputs with the model's own processor (its chat template, its image-token expansion, its pixel
preprocessing), with ``labels`` on the assistant turns only; `collate_vision` pads rows into a batch.

Assistant-only labels: the chat is rendered once in full and, for each assistant turn, up to the turn's start
(with the generation prompt) and up to its end; the tokens between are labelled. This needs the template to render
a conversation's start as a prefix of the whole (every common template does); one that does not is an error.

A processor that needs a video processor (Qwen2-VL's) loads without it when torchvision is missing
(`images_only_processor`: images and text only). `multimodal_token_types` rebuilds from the ids the per-token
modality types a model with 3-D rotary positions (Qwen2-VL's M-RoPE) needs beside the image tensors.

`vision_request(processor, messages, images)` is an image prompt for an engine (`posttrain.rollout.HFEngine`): the
prompt's ids with the image tokens expanded, and the image tensors beside them.

`build_tiny_vlm(tokenizer)` is the built-in tiny VLM: a 2-layer CLIP-style vision encoder (32x32 pixels, 8x8
patches: 16 image tokens), LLaVA's two-layer MLP projector and the tiny Llama (`posttrain.models.tiny`), as an
ordinary `LlavaForConditionalGeneration` with its `LlavaProcessor`: `save_pretrained` both into one directory and
`load_vision_model` (or plain transformers) reads it back.
"""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    CLIPVisionConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
)

from posttrain.config import ModelConfig
from posttrain.models.load import ModelError, _load_error, _require_dir_or_hub_id
from posttrain.models.tiny import tiny_config
from posttrain.types import GenerationRequest

if TYPE_CHECKING:  # Pillow is the `vision` extra: imported where images are handled, not by `import posttrain`
    from PIL import Image
    from transformers import LlavaProcessor

IGNORE_INDEX = -100
IMAGE_TOKEN = "<image>"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def vision_chat_template(image_text: str) -> str:
    """The built-in chat template (`posttrain.models.tokenizer`) with list contents: text parts as text, each
    image part as `image_text` (the processor's image placeholder, which it expands to the image's tokens)."""
    return (
        "{%- for message in messages -%}"
        "<|{{ message['role'] }}|>"
        "{%- if message['content'] is string -%}{{ message['content'] }}"
        "{%- else -%}{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'image' -%}" + image_text + "{%- else -%}{{ part['text'] }}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "<|end|>"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
    )


def load_vision_model(path: str, *, dtype: str = "float32",
                      device: torch.device | str = "cpu") -> tuple[PreTrainedModel, ProcessorMixin]:
    """The image-text-to-text model at `path` (a local directory or hub id) and its processor."""
    if dtype not in _DTYPES:
        raise ModelError(f"model.dtype: expected one of {', '.join(_DTYPES)}, got {dtype!r}")
    processor = load_processor(path)
    try:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=_DTYPES[dtype])
    except (OSError, ValueError) as error:
        raise _load_error(path, "model.path", "not an image-text-to-text model directory", error) from None
    return model.to(device), processor


def load_processor(path: str) -> ProcessorMixin:
    """The processor of the vision-language model at `path` (no weights loaded), with its chat template; one whose
    video processor cannot be built (no torchvision) is built without it (`images_only_processor`)."""
    _require_dir_or_hub_id(path, "model.path")
    try:
        processor = AutoProcessor.from_pretrained(path)
    except (OSError, ValueError, ImportError) as error:
        # Qwen2-VL's processor builds a video processor, which needs torchvision (or its saved config: a processor
        # saved without one, as `images_only_processor` saves)
        processor = _without_video(path, error)
    if not hasattr(processor, "image_processor"):
        raise ModelError(f"{path}: the processor ({type(processor).__name__}) has no image processor: "
                         "not a vision-language model")
    if not getattr(processor, "chat_template", None) and not getattr(processor.tokenizer, "chat_template", None):
        raise ModelError(f"{path}: the processor has no chat template; save one with the processor "
                         "(processor.chat_template = ...; processor.save_pretrained(path))")
    return processor


def _without_video(path: str, error: Exception) -> ProcessorMixin:
    """The processor at `path` built from its image processor and tokenizer when only its video processor failed to
    load (every video processor of transformers needs torchvision; images never do): see `images_only_processor`.
    Any other failure is a one-line error."""
    reason = " ".join(str(error).split())[:300]
    if isinstance(error, ImportError):
        failed = ModelError(f"{path}: its processor needs a library that is not installed: {reason}")
    else:
        failed = _load_error(path, "model.path", "could not load a processor", error)
    if "videoprocessor" not in reason.lower().replace(" ", ""):
        raise failed from None
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    name = None
    for file in ("processor_config.json", "preprocessor_config.json"):
        if (Path(path) / file).is_file():
            name = name or json.loads((Path(path) / file).read_text()).get("processor_class")
    processor_class = getattr(transformers, name or "", None)
    if processor_class is None or "video_processor" not in processor_class.get_attributes():
        raise failed from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        chat_template = _saved_chat_template(Path(path)) or getattr(tokenizer, "chat_template", None)
        return images_only_processor(processor_class, image_processor=AutoImageProcessor.from_pretrained(path),
                                     tokenizer=tokenizer, chat_template=chat_template)
    except (OSError, ValueError, ImportError):
        raise failed from None


def _saved_chat_template(directory: Path) -> str | None:
    """A processor's chat template as transformers saves it: `chat_template.jinja`, or (older) `chat_template.json`."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    if (directory / "chat_template.json").is_file():
        return json.loads((directory / "chat_template.json").read_text()).get("chat_template")
    return None


def images_only_processor(processor_class: type[ProcessorMixin], **parts: Any) -> ProcessorMixin:
    """`processor_class` (e.g. `Qwen2VLProcessor`) without its video processor: images and text go through it as
    through the full processor; a video cannot be processed (there is no video processor to run it).

    transformers' processors insist on every part, and its video processors all need torchvision, which
    ``posttrain[vision]`` does not install: PyPI's build is made against the CUDA torch of its release (beside a CPU
    torch its ops do not load; an unpinned one pulls another torch), the CPU build lives on PyTorch's own index.
    Here the video processor is not one of the processor's parts: not checked, not saved (`save_pretrained` writes
    the image processor, tokenizer and chat template and names `processor_class`; `load_processor` builds it
    images-only again, with or without torchvision, as the saved config names no video processor)."""
    def get_attributes(cls: type) -> list[str]:
        return [name for name in processor_class.get_attributes() if name != "video_processor"]

    images_only = type(processor_class.__name__, (processor_class,), {"get_attributes": classmethod(get_attributes)})
    processor = images_only(**parts)
    processor.video_processor = None
    return processor


def vision_inputs(processor: ProcessorMixin, messages: Sequence[dict[str, Any]],
                  images: Sequence[Image.Image], *, labels: bool = True) -> dict[str, torch.Tensor]:
    """One chat's model inputs (batch of one) from the model's processor, with assistant-only ``labels``.

    `messages` hold text and ``{"type": "image"}`` parts in order; `images` are the images they refer to. With
    ``labels=False`` the chat is a prompt: it is rendered with the generation prompt and carries no labels.
    """
    image_count = _image_parts(messages)
    if image_count != len(images):
        raise ModelError(f"the chat has {image_count} image part(s) but {len(images)} image(s) were given")
    if not labels:
        return dict(_encode(processor, _render(processor, messages, prompt=True), list(images)))
    full = _encode(processor, _render(processor, messages, prompt=False), list(images))
    ids = full["input_ids"][0]
    target = torch.full_like(ids, IGNORE_INDEX)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _prefix_length(processor, messages[:index], images, ids, prompt=True)
        end = _prefix_length(processor, messages[: index + 1], images, ids, prompt=False)
        target[start:end] = ids[start:end]
    if not (target != IGNORE_INDEX).any():
        raise ModelError("the chat has no assistant tokens to train on")
    return {**full, "labels": target.unsqueeze(0)}


TEXT_KEYS = ("input_ids", "attention_mask", "labels", "token_type_ids", "mm_token_type_ids")


def vision_request(processor: ProcessorMixin, messages: Sequence[dict[str, Any]], images: Sequence[Image.Image],
                   request_id: str = "") -> GenerationRequest:
    """An engine request for the chat `messages` (prompt turns; rendered with the generation prompt) and its
    images: the processor's ids (image tokens expanded) and every other tensor it made (``pixel_values`` ...)."""
    row = vision_inputs(processor, messages, images, labels=False)
    extra = {key: value for key, value in row.items() if key not in TEXT_KEYS}
    return GenerationRequest(row["input_ids"][0].tolist(), request_id, image_inputs=extra or None)


def multimodal_token_types(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Each token's modality (0 text, 1 image, 2 video), rebuilt from `input_ids`, for a model whose forward takes
    them (``mm_token_type_ids``: Qwen2-VL and its kin place their 3-D rotary positions by them; their processor
    makes the same tensor from the same ids); None for any other model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    image = getattr(base.config, "image_token_id", None)
    if image is None or "mm_token_type_ids" not in inspect.signature(base.forward).parameters:
        return None
    types = (input_ids == image).long()
    video = getattr(base.config, "video_token_id", None)
    if video is not None:
        types = types + 2 * (input_ids == video).long()
    return types


def image_placeholder_ids(model: torch.nn.Module) -> frozenset[int]:
    """The token ids a vision-language model's processor puts where an image's (or video's) features go; empty for
    a text model. The engine ends a reply before one (`rollout.stopping`): the model's forward would take a sampled
    one for an image slot."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None:
        return frozenset()
    ids = (getattr(config, name, None) for name in ("image_token_id", "image_token_index", "video_token_id"))
    return frozenset(i for i in ids if isinstance(i, int) and i >= 0)


def collate_vision(rows: Sequence[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad `vision_inputs` rows into one batch; image tensors (pixel values, grids) are concatenated along
    their first axis, which is how every processor batches them (one entry per image, or per patch)."""
    width = max(row["input_ids"].shape[1] for row in rows)
    pad_with = {"input_ids": pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX, "token_type_ids": 0,
                "mm_token_type_ids": 0}
    batch: dict[str, torch.Tensor] = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        if key in pad_with:
            batch[key] = torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[1]), value=pad_with[key])
                                    for v in values])
        else:
            batch[key] = torch.cat(values)
    return batch


def build_tiny_vlm(tokenizer: PreTrainedTokenizerBase, preset: str = "tiny-1m", seed: int = 0,
                   image_size: int = 32, patch_size: int = 8) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """The built-in tiny VLM for `tokenizer` (a copy gets the ``<image>`` token and the vision chat template)."""
    if image_size % patch_size:
        raise ModelError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
    try:
        from transformers import CLIPImageProcessor, LlavaProcessor
        import PIL  # noqa: F401  (the image processor needs it; say so before transformers does)
    except ImportError:
        raise ModelError("the tiny VLM's processor needs Pillow: pip install 'posttrain[vision]'") from None
    tokenizer = copy.deepcopy(tokenizer)
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    text_config = tiny_config(preset, tokenizer)
    vision_config = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=2, image_size=image_size, patch_size=patch_size)
    config = LlavaConfig(vision_config=vision_config, text_config=text_config,
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         projector_hidden_act="gelu", vision_feature_layer=-1,
                         vision_feature_select_strategy="default")
    with torch.random.fork_rng(devices=[]):  # building never perturbs the caller's RNG stream
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    # CLIP keeps a CLS token beside the patches and the "default" strategy drops it: one extra token to count.
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               image_token=IMAGE_TOKEN, chat_template=vision_chat_template(IMAGE_TOKEN))
    return model, processor


def _image_parts(messages: Sequence[dict[str, Any]]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and part.get("type") == "image")


def _render(processor: ProcessorMixin, messages: Sequence[dict[str, Any]], prompt: bool) -> str:
    return processor.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=prompt)


def _encode(processor: ProcessorMixin, text: str, images: list[Image.Image]) -> Any:
    return processor(text=[text], images=images or None, return_tensors="pt")


def _prefix_length(processor: ProcessorMixin, messages: Sequence[dict[str, Any]], images: Sequence[Image.Image],
                   full_ids: torch.Tensor, prompt: bool) -> int:
    """How many of the full chat's tokens the first `messages` render to; the render must be a prefix."""
    if not messages:
        raise ModelError("an assistant turn cannot open the chat: nothing comes before it to condition on")
    ids = _encode(processor, _render(processor, messages, prompt), list(images[: _image_parts(messages)]))
    ids = ids["input_ids"][0]
    if ids.shape[0] > full_ids.shape[0] or not torch.equal(ids, full_ids[: ids.shape[0]]):
        raise ModelError("the chat template does not render a conversation's first turns as a prefix of the "
                         "whole; assistant-only labels cannot be placed")
    return int(ids.shape[0])


# ---- a recipe's policy as a vision-language model (the sft, dpo and rl recipes) ----------------------------------

def wants_vision(model: ModelConfig) -> bool:
    """Whether the recipe's policy is a vision-language model: ``model.vision``, or a local ``model.path`` whose
    config has a ``vision_config``."""
    if model.vision:
        return True
    config = Path(model.path) / "config.json" if model.path else None
    if config is None or not config.is_file():
        return False
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def load_vision_policy(model: ModelConfig, tokenizer: Any, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """A recipe's policy as a vision-language model and its processor: `model.path` (`models.load_vision_model`), or the
    built-in tiny VLM (`models.build_tiny_vlm`, the `model.preset` text model) for `tokenizer` (a fresh run's)."""
    if model.lora.enabled:
        raise ModelError("model.lora: LoRA on a vision-language model is not supported yet (docs/multimodal.md)")
    if model.rope_scaling is not None:
        raise ModelError("model.rope_scaling: not supported with model.vision")
    if model.path is None:
        policy, processor = build_tiny_vlm(tokenizer, preset=model.preset, seed=model.seed)
        return policy.to(device), processor
    return load_vision_model(model.path, dtype=model.dtype, device=device)


def policy_processor(model: ModelConfig, tokenizer: Any) -> Any:
    """The processor `load_vision_policy` would give, without loading the weights (`posttrain validate`)."""
    if model.path is None:
        return build_tiny_vlm(tokenizer, preset=model.preset, seed=model.seed)[1]
    return load_processor(model.path)
