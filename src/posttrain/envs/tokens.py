"""Token in, token out: build a multi-turn sequence from the engine's ids plus chat-template deltas.

The sequence the trainer scores is built by appending, never by re-rendering:

* the prompt: the task's messages rendered by the chat template with the generation prompt, tokenized once;
* a policy turn: exactly the ids the engine returned (``loss_mask`` 1, with behaviour logprobs and version);
* an observation: the *text delta* the template adds for the new messages -- render the transcript without and
  with them (the latter with the next generation prompt), keep the string suffix -- tokenized on its own
  (``loss_mask`` 0). If the policy's turn stopped short of the template's end of turn (a stop string instead of
  eos, or a template that writes a newline after eos), the missing closing text is prepended to the delta.

The prompt's ids are cached per tokenizer (keyed by the messages, tools and template arguments; emptied when the
tokenizer's chat template changes): the members of a GRPO group share their prompt, and rendering a chat template
is the costly part of starting an episode.

**Image prompts.** Given a `PromptRenderer` (a vision-language model's processor behind a protocol: envs may not
import `models`; the rl room builds one, `posttrain.rl.vision.ProcessorRenderer`), the prompt's ids are the
renderer's (the processor's expansion of each image into image tokens) and its image tensors are kept beside them
(`image_inputs`: every turn's `GenerationRequest` carries them, the trajectory keeps them for the trainer); the
deltas are rendered by the renderer's template (the processor's). Images come in the prompt only: an observation
holding an image is an `EnvError`.

So the policy's text is never tokenized again, and for a prefix-stable template decoding the sequence gives the
template's rendering of the transcript. A template that rewrites earlier turns when a message is added (so the
shorter rendering is not a prefix of the longer) cannot be used this way and raises `EnvError`.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import Any, Protocol

from posttrain.chat import ChatTemplateError, encode_rendered, first_image_message, render_chat, require_prefix
from posttrain.envs.base import EnvError
from posttrain.types import Completion, Message

_PROMPT_CACHE_SIZE = 4096  # prompts per tokenizer
# tokenizer -> (the chat template rendered with, prompt key -> ids)
_prompt_caches: weakref.WeakKeyDictionary[Any, tuple[Any, OrderedDict[str, tuple[int, ...]]]] = (
    weakref.WeakKeyDictionary())
_prompt_lock = threading.Lock()


def strip_eos(text: str, tokenizer: Any) -> str:
    """A completion's text without the tokenizer's eos at its end (what the env, or an agent, reads of a turn;
    the ids keep it)."""
    eos = getattr(tokenizer, "eos_token", None)
    return text[: -len(eos)] if eos and text.endswith(eos) else text


class PromptRenderer(Protocol):
    """Turns a prompt holding images into the ids an engine is prompted with and the image tensors beside them."""

    def prompt(self, messages: list[Message], tools: list[dict[str, Any]] | None,
               template_kwargs: dict[str, Any]) -> tuple[list[int], dict[str, Any] | None]:
        """The prompt's ids (rendered with the generation prompt, image tokens expanded) and its image tensors
        (None for a prompt without images)."""
        ...

    def render(self, messages: list[Message], *, generation_prompt: bool, tools: list[dict[str, Any]] | None,
               template_kwargs: dict[str, Any]) -> str:
        """The template's text for `messages` (each image as its placeholder), as `posttrain.chat.render_chat`."""
        ...


class TranscriptTokens:
    def __init__(self, tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]] | None = None,
                 template_kwargs: dict[str, Any] | None = None, renderer: PromptRenderer | None = None):
        self.tokenizer = tokenizer
        self.renderer = renderer
        self.image_inputs: dict[str, Any] | None = None  # the prompt's image tensors (a renderer's)
        self.tools = tools or None
        self.template_kwargs = dict(template_kwargs or {})
        self.messages: list[Message] = [dict(m) for m in messages]
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.behaviour_logprobs: list[float] = []
        self.policy_versions: list[int] = []
        self._last_turn_ids: list[int] = []
        self._append(self._prompt_ids())
        self.prompt_length = len(self.token_ids)

    def _prompt_ids(self) -> list[int]:
        """The rendered prompt's ids, from the tokenizer's cache when this prompt was seen before (a renderer
        keeps its own)."""
        if self.renderer is not None:
            ids, self.image_inputs = self.renderer.prompt(self.messages, self.tools, self.template_kwargs)
            return list(ids)
        template = getattr(self.tokenizer, "chat_template", None)
        try:
            key = json.dumps([self.messages, self.tools, self.template_kwargs], sort_keys=True)
            with _prompt_lock:
                cached = _prompt_caches.get(self.tokenizer)
                if cached is None or cached[0] != template:  # new, or the template changed: renderings are stale
                    cached = _prompt_caches[self.tokenizer] = (template, OrderedDict())
                ids = cached[1].get(key)
                if ids is not None:
                    cached[1].move_to_end(key)
                    return list(ids)
        except TypeError:  # a message or template argument JSON cannot hold, or a tokenizer without weak refs
            return self._encode(self.render(self.messages, generation_prompt=True))
        ids = tuple(self._encode(self.render(self.messages, generation_prompt=True)))
        with _prompt_lock:
            cached[1][key] = ids
            if len(cached[1]) > _PROMPT_CACHE_SIZE:
                cached[1].popitem(last=False)
        return list(ids)

    def render(self, messages: list[Message], generation_prompt: bool) -> str:
        try:
            if self.renderer is not None:
                return self.renderer.render(messages, generation_prompt=generation_prompt, tools=self.tools,
                                            template_kwargs=self.template_kwargs)
            return render_chat(self.tokenizer, messages, generation_prompt=generation_prompt, tools=self.tools,
                               template_kwargs=self.template_kwargs)
        except ChatTemplateError as error:
            raise EnvError(str(error)) from error

    def add_policy_turn(self, completion: Completion, assistant_message: Message) -> None:
        """Append the engine's ids verbatim; `assistant_message` is the turn as the transcript records it."""
        if len(completion.logprobs) != len(completion.token_ids):
            raise EnvError(
                f"engine returned {len(completion.token_ids)} tokens but {len(completion.logprobs)} logprobs"
            )
        self.token_ids += completion.token_ids
        self.loss_mask += [1] * len(completion.token_ids)
        self.behaviour_logprobs += [float(x) for x in completion.logprobs]
        self.policy_versions += [int(completion.policy_version)] * len(completion.token_ids)
        self.messages.append(assistant_message)
        self._last_turn_ids = list(completion.token_ids)

    def add_observation(self, new_messages: list[Message]) -> list[int]:
        """Append the template's delta for `new_messages` plus the next generation prompt; returns its ids."""
        if self.renderer is not None and first_image_message(new_messages) is not None:
            raise EnvError("an observation holds an image: images are taken in the prompt only (the engine's "
                           "prefill gets the prompt's image tensors; a later image would be dropped)")
        before = self.render(self.messages, generation_prompt=False)
        after = self.render(self.messages + new_messages, generation_prompt=True)
        try:
            require_prefix(before, after, part="the conversation", whole="it with the new messages",
                           purpose="observations cannot be appended as token deltas")
        except ChatTemplateError as error:
            raise EnvError(str(error)) from None
        ids = self._encode(self._turn_closure() + after[len(before):])
        self._append(ids)
        self.messages += [dict(m) for m in new_messages]
        return ids

    def _turn_closure(self) -> str:
        """Text the template puts after the last assistant turn's content that the policy did not produce."""
        head = self.render(self.messages[:-1], generation_prompt=True)
        full = self.render(self.messages, generation_prompt=False)
        turn = full[len(head):] if full.startswith(head) else ""
        produced = self.tokenizer.decode(self._last_turn_ids, skip_special_tokens=False)
        if produced and turn.startswith(produced):
            return turn[len(produced):]
        # The policy wrote the turn differently from the template (e.g. other JSON spacing): close it after the
        # template's end-of-turn token, adding that token only if the policy did not emit it.
        eos = getattr(self.tokenizer, "eos_token", None)
        if not eos or eos not in turn:
            return ""
        tail = turn[turn.rfind(eos):]
        ended = bool(self._last_turn_ids) and self._last_turn_ids[-1] == self.tokenizer.eos_token_id
        return tail[len(eos):] if ended else tail

    def _encode(self, text: str) -> list[int]:
        return encode_rendered(self.tokenizer, text)

    def _append(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.behaviour_logprobs += [0.0] * len(ids)
        self.policy_versions += [-1] * len(ids)
