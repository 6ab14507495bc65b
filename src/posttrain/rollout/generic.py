"""The general path: any Hugging Face causal LM through its own forward and cache object.

Slower than `DecoderRunner` (the module tree, mask building and cache bookkeeping run at every step) but it
works for any model whose forward takes ``attention_mask``, ``position_ids`` and a cache, which is every
decoder-only model in transformers, a PEFT-wrapped one included. Prompts are left-padded; position ids
count real tokens only, so a padded prompt sees the positions it would see alone.

The group expansion and the compaction use the cache's own ``batch_repeat_interleave`` /
``batch_select_indices`` (transformers' `DynamicCache`).

Image prompts (a vision-language model such as LLaVA): the prefill also gets the prompts' image tensors, joined
along their first axis in prompt order (how every processor batches them); the model puts each image's features
in place of its image tokens, so later steps decode from the cache alone. A model that computes its own position
ids for images (Qwen2-VL's 3-D rotary positions) is not supported here: its position ids are not one per token.
"""

from __future__ import annotations

import contextlib
import inspect

import torch


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


class GenericRunner:
    """Prefill, decode and compaction through ``model.forward`` with a dynamic KV cache."""

    def __init__(self, model: torch.nn.Module, autocast: torch.dtype | None = None):
        self.model = model
        self.autocast = autocast
        self.device = next(model.parameters()).device
        self.cache_keyword, self.keep_last = _forward_keywords(model)
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
        self.cache = None
        logits = self._run(ids, positions, self._images(image_inputs or []))
        if rows_per_prompt > 1:
            self.cache.batch_repeat_interleave(rows_per_prompt)
            self.mask = self.mask.repeat_interleave(rows_per_prompt, dim=0)
            logits = logits.repeat_interleave(rows_per_prompt, dim=0)
        self.positions = self.mask.sum(-1)
        return logits

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
        logits = self._run(tokens[:, None], self.positions[:, None])
        self.positions = self.positions + 1
        return logits

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
        self.positions = self.positions[rows]

    def release(self) -> None:
        self.cache = None
