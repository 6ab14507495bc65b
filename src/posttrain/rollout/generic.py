"""The general path: any Hugging Face causal LM through its own forward and cache object.

Slower than `DecoderRunner` (the module tree, mask building and cache bookkeeping run at every step) but it
works for any model whose forward takes ``attention_mask``, ``position_ids`` and a cache, which is every
decoder-only model in transformers, a PEFT-wrapped one included. Prompts are left-padded; position ids
count real tokens only, so a padded prompt sees the positions it would see alone.

The group expansion and the compaction use the cache's own ``batch_repeat_interleave`` /
``batch_select_indices`` (transformers' `DynamicCache`).

Image prompts (a vision-language model such as LLaVA): the prefill also gets the prompts' image tensors, joined
along their first axis in prompt order (how every processor batches them); the model puts each image's features
in place of its image tokens, so later steps decode from the cache alone.

Multimodal rotary positions (M-RoPE: Qwen2-VL, and the families whose inner model has the same `get_rope_index`):
an image token's position is 3-D (time, row, column in the image's grid) and the text after an image continues
from the largest of them, not from its token count. The prefill asks the model's own `get_rope_index` for the
[3, rows, width] positions of the left-padded prompts (the token types rebuilt from the ids, as
`models.multimodal_token_types`) and keeps each row's ``delta`` (its largest position + 1 minus its real tokens);
a decode step's position is then the row's real-token count plus its delta, the same on all three axes (what
transformers' own generation computes). The deltas follow the rows through group expansion, compaction and `join`.

`join` adds prompts to a running batch (continuous batching): the new prompts are prefilled on their own, then
the shorter of the two caches is left-padded (masked columns) to the other's length and the two are stacked on
the batch dimension, layer by layer. A sliding-window layer keeps only its last ``window - 1`` columns and
counts every column it has seen (``cumulative_length``, which places the window in the mask): padding one moves
its count to the new length and adds masked columns only while the window is not yet full. Caches of any other
layer kind (static, quantized, linear attention) cannot be stacked this way: `joinable` says so, and the
caller admits new prompts only into an empty batch.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from posttrain.models import multimodal_token_types
from posttrain.rollout.errors import RolloutError


def _forward_keywords(model: torch.nn.Module) -> tuple[str, dict[str, int]]:
    """The cache keyword and the keep-only-the-last-logits keyword this model's forward takes."""
    # A PEFT model forwards **kwargs to the model it wraps: look at that one's signature.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = inspect.signature(base.forward).parameters
    # transformers 5 renamed `past_key_values` to `cache` (the old name still works, with a warning).
    cache = "cache" if "cache" in parameters else "past_key_values"
    for keep in ("logits_to_keep", "num_logits_to_keep"):
        if keep in parameters:
            return cache, {keep: 1}
    return cache, {}


def _rope_index(model: torch.nn.Module):
    """The model's multimodal rotary position function (`get_rope_index` of its inner model), or None for a model
    whose positions are one per token. A `get_rope_index` this runner cannot call is an error, never skipped."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    rope_index = getattr(getattr(base, "model", None), "get_rope_index", None)
    if rope_index is None:
        return None
    probe = torch.zeros(1, 1, dtype=torch.long)
    if ("mm_token_type_ids" not in inspect.signature(rope_index).parameters
            or multimodal_token_types(base, probe) is None):
        raise RolloutError(f"{type(base).__name__} computes its own rotary positions with a get_rope_index the "
                           "engine cannot call (no mm_token_type_ids in it or in the model's forward, or no "
                           "image_token_id in its config); it has no runner here")
    return rope_index


class GenericRunner:
    """Prefill, decode and compaction through ``model.forward`` with a dynamic KV cache."""

    def __init__(self, model: torch.nn.Module, autocast: torch.dtype | None = None):
        self.model = model
        self.autocast = autocast
        self.device = next(model.parameters()).device
        self.cache_keyword, self.keep_last = _forward_keywords(model)
        self.rope_index = _rope_index(model)
        self.cache = None

    def _context(self) -> contextlib.AbstractContextManager:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, extra: dict[str, torch.Tensor] | None = None
             ) -> torch.Tensor:
        with self._context():
            output = self.model(
                input_ids=ids,
                attention_mask=self.mask,
                position_ids=positions,
                use_cache=True,
                **self.keep_last,
                **({self.cache_keyword: self.cache} if self.cache is not None else {}),
                **(extra or {}),
            )
        self.cache = getattr(output, self.cache_keyword, None)
        if self.cache is None:
            self.cache = output.past_key_values
        return output.logits[:, -1].float()

    def kv_bytes(self) -> int:
        """Bytes the cache object's key/value tensors hold now."""
        total = 0
        for layer in getattr(self.cache, "layers", None) or []:
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
        return total

    def prefill(self, prompts: list[list[int]], rows_per_prompt: int, max_new_tokens: int,
                image_inputs: list[dict[str, torch.Tensor] | None] | None = None) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        ids, self.mask = ids.to(self.device), mask.to(self.device)
        positions = (self.mask.cumsum(-1) - 1).clamp_(min=0)
        images = self._images(image_inputs or [])
        self.deltas = torch.zeros(len(prompts), dtype=torch.long, device=self.device)
        if self.rope_index is not None:
            positions, self.deltas = self._multimodal_positions(ids, images)
        self.cache = None
        logits = self._run(ids, positions, images)
        if rows_per_prompt > 1:
            self.cache.batch_repeat_interleave(rows_per_prompt)
            self.mask = self.mask.repeat_interleave(rows_per_prompt, dim=0)
            self.deltas = self.deltas.repeat_interleave(rows_per_prompt)
            logits = logits.repeat_interleave(rows_per_prompt, dim=0)
        self.positions = self.mask.sum(-1)
        return logits

    def _multimodal_positions(self, ids: torch.Tensor, images: dict[str, torch.Tensor] | None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """[3, rows, width] M-RoPE positions of the left-padded prompts (padding at 0, masked) and each row's delta."""
        images = images or {}
        positions, deltas = self.rope_index(
            ids, mm_token_type_ids=multimodal_token_types(self.model, ids), attention_mask=self.mask,
            image_grid_thw=images.get("image_grid_thw"), video_grid_thw=images.get("video_grid_thw"))
        return positions, deltas.reshape(-1).to(self.device)

    def _images(self, image_inputs: list[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor] | None:
        """The prompts' image tensors joined along the first axis, in prompt order (None: no image prompt)."""
        present = [inputs for inputs in image_inputs if inputs]
        if not present:
            return None
        keys = present[0].keys()
        if any(inputs.keys() != keys for inputs in present):
            raise ValueError("image prompts of one batch carry different image inputs: "
                             f"{sorted(keys)} vs {sorted(next(i for i in present if i.keys() != keys))}")
        dtype = next(self.model.parameters()).dtype
        joined = {}
        for key in keys:
            value = torch.cat([inputs[key] for inputs in present]).to(self.device)
            joined[key] = value.to(dtype) if value.is_floating_point() else value
        return joined

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=1)
        # M-RoPE: a generated token's position is the same on all three axes (the model expands a 2-D one)
        logits = self._run(tokens[:, None], (self.positions + self.deltas)[:, None])
        self.positions = self.positions + 1
        return logits

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
        self.positions = self.positions[rows]
        self.deltas = self.deltas[rows]

    def release(self) -> None:
        self.cache = None

    @property
    def rows(self) -> int:
        return 0 if self.cache is None else len(self.positions)

    def joinable(self) -> bool:
        """Whether `join` can add prompts to the running rows (every cache layer a dynamic one)."""
        layers = getattr(self.cache, "layers", None)
        return bool(layers) and all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) and layer.is_initialized
                                    for layer in layers)

    def join(self, prompts: list[list[int]], rows_per_prompt: int, capacity: int) -> torch.Tensor:
        """Add `prompts` (each with `rows_per_prompt` rows) after the running rows; logits [new rows, vocab]."""
        if not self.rows:
            return self.prefill(prompts, rows_per_prompt, capacity)
        if not self.joinable():
            raise RuntimeError(f"GenericRunner.join: a {type(self.cache).__name__} with layers of kinds "
                               f"{sorted({type(l).__name__ for l in self.cache.layers})} cannot take new rows")
        old_cache, old_mask, old_positions, old_deltas = self.cache, self.mask, self.positions, self.deltas
        logits = self.prefill(prompts, rows_per_prompt, capacity)
        width = max(old_mask.shape[1], self.mask.shape[1])
        for old, new in zip(old_cache.layers, self.cache.layers, strict=True):
            _pad_layer(old, width)
            _pad_layer(new, width)
            old.keys = torch.cat([old.keys, new.keys])
            old.values = torch.cat([old.values, new.values])
        self.cache = old_cache
        self.mask = torch.cat([_pad_mask(old_mask, width), _pad_mask(self.mask, width)])
        self.positions = torch.cat([old_positions, self.positions])
        self.deltas = torch.cat([old_deltas, self.deltas])
        return logits


def _pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([mask.new_zeros(len(mask), width - mask.shape[1]), mask], dim=1)


def _pad_layer(layer: DynamicLayer, width: int) -> None:
    """Left-pad a cache layer to what it would hold had it seen `width` columns, the first ones masked."""
    kept = width
    if isinstance(layer, DynamicSlidingWindowLayer):
        kept = min(width, layer.sliding_window - 1)
        layer.cumulative_length = width
    missing = kept - layer.keys.shape[-2]
    if missing > 0:
        layer.keys = torch.cat([layer.keys.new_zeros(*layer.keys.shape[:-2], missing, layer.keys.shape[-1]),
                                layer.keys], dim=-2)
        layer.values = torch.cat([layer.values.new_zeros(*layer.values.shape[:-2], missing,
                                                         layer.values.shape[-1]), layer.values], dim=-2)
