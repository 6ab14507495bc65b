"""The chat template, called in one place: every room renders conversations through these functions.

Training (SFT, DPO and RM pairs, the RL self-test, the guard's replay SFT), the episode loop, the server, the chat
command and the reward model all turn messages into text and ids the same way:

* `render_chat` — the template's text for the messages (``tokenize=False``), with or without the generation
  prompt, with the tools and template arguments given; a template that fails is a `ChatTemplateError`;
* `chat_ids` — that text tokenized with ``add_special_tokens=False`` (the template writes the special tokens
  itself, so adding them again would double the BOS of a Llama template);
* `require_prefix` — the one prefix-stability check: a conversation's rendering must start with the rendering of
  what came before it, or a reply cannot be located in it (training masks) and an observation cannot be appended
  as a token delta (episodes). Templates that rewrite earlier turns fail here with the same message everywhere.

Like `posttrain.types` it imports nothing of ours but `types`, so every room may import it. A room raises its own
error type for its users (`DataError`, `EnvError`, the server's 400) from a `ChatTemplateError`, with its message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from posttrain.types import Message, PosttrainError

FIX_HINT = ("set model.chat_template to a template that renders the earlier turns the same way whatever follows "
            "them")


class ChatTemplateError(PosttrainError):
    """The chat template cannot render these messages, or it rewrites earlier turns when one is added."""


def render_chat(tokenizer: Any, messages: Sequence[Message], *, generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
                images: bool = False) -> str:
    """The template's text for `messages`, ending with the generation prompt when `generation_prompt`.

    A message holding an image part is refused unless `images`: a text tokenizer's template would drop the image
    silently (the built-in one renders no list content at all), so an image task would train on an empty prompt.
    Images go through a vision model's processor (`posttrain.models.vision_inputs`); `images=True` is for that
    path alone -- `tokenizer` is then the processor, whose template writes each image's placeholder (the episode
    loop's observation deltas on an image prompt, `posttrain.rl.vision.ProcessorRenderer`)."""
    index = None if images else first_image_message(messages)
    if index is not None:
        raise ChatTemplateError(f"message {index} holds an image part, which a text-only chat template cannot "
                                "render; image prompts need a vision-language model and its processor "
                                "(docs/multimodal.md: set model.vision in an RL recipe)")
    if hasattr(tokenizer, "chat_template") and not tokenizer.chat_template:  # (a stand-in may not have one)
        raise ChatTemplateError("the tokenizer has no chat template; set model.chat_template in the recipe (a Jinja "
                                "template or a file holding one)")
    try:
        return tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=False,
                                             add_generation_prompt=generation_prompt, **(template_kwargs or {}))
    except Exception as error:  # noqa: BLE001 - jinja raises TemplateError, templates raise their own exceptions
        raise ChatTemplateError(f"the chat template failed on {len(messages)} messages: {error}") from error


IMAGE_PART_TYPES = ("image", "image_url")


def first_image_message(messages: Sequence[Message]) -> int | None:
    """The index of the first message holding an image part (None when the chat is text only)."""
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
                                             for part in content):
            return index
    return None


def encode_rendered(tokenizer: Any, text: str) -> list[int]:
    """The ids of text the template rendered (its special tokens are in the text already)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_ids(tokenizer: Any, messages: Sequence[Message], *, generation_prompt: bool = True,
             tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The ids of `messages` rendered (by default with the generation prompt: what the model is prompted with)."""
    return encode_rendered(tokenizer, render_chat(tokenizer, messages, generation_prompt=generation_prompt,
                                                  tools=tools, template_kwargs=template_kwargs))


def require_prefix(before: str, after: str, *, part: str, whole: str, purpose: str) -> None:
    """Raise `ChatTemplateError` unless the rendering `after` (of `whole`) starts with `before` (of `part`).
    `purpose` says what the prefix is needed for, in the message."""
    if not after.startswith(before):
        raise ChatTemplateError(f"the chat template is not prefix-stable: rendering {part} is not a prefix of "
                                f"rendering {whole}, so {purpose}; {FIX_HINT}")
