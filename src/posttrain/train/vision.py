"""Training a vision-language model on chats with images: SFT (assistant tokens only), DPO on image pairs, and the
teacher-forced log-probs of sampled tokens that the RL update and the engine self-test need.

The model is any `AutoModelForImageTextToText` with its processor (`posttrain.models.load_vision_model`, or the
built-in `build_tiny_vlm`); a chat's inputs come from the processor (`posttrain.models.vision_inputs`), so the image
tokens, the pixel preprocessing and the chat template are the model's own.

* `vision_sft_loss`: the mean cross-entropy over the batch's assistant tokens (labels from `vision_inputs`), the same
  objective as text SFT's token mean.
* `vision_dpo_loss`: sigmoid DPO (`train.preference_losses.dpo_loss`) on summed log-probs of the chosen and the
  rejected reply, each scored by the policy and by a frozen reference with the same prompt and images.
* `completion_logprobs`: log p(completion token | prompt, images, earlier tokens) under ``log_softmax(logits / T)``,
  for token ids as the engine sampled them (never re-tokenized): rows right-padded, one forward with the images.

`run_vision_sft` and `run_vision_dpo` are the short loops (AdamW, a fixed number of steps, one seed) the tests and
the `vlm-demo` recipe use; packing image rows is not supported (each chat is a row).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from posttrain.data import VisionSample
from posttrain.config import OptimConfig
from posttrain.data import IGNORE_INDEX, vision_texts
from posttrain.models import (VISION_TEXT_KEYS as TEXT_KEYS, collate_vision, load_tokenizer, load_vision_policy,
                              multimodal_token_types, vision_inputs)
from posttrain.train.checkpoint import open_run_dir
from posttrain.train.forward import target_logprobs
from posttrain.train.optim import build_scheduler
from posttrain.train.preference_losses import dpo_loss
from posttrain.train.step import Runtime, setup_runtime

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["ImageSequence", "VisionPair", "completion_logprobs", "run_vision_dpo", "run_vision_sft",
           "vision_dpo_loss", "vision_loss_sum", "vision_sft_loss"]


@dataclass
class ImageSequence:
    """A prompt (ids with image tokens expanded, and its image tensors) and a completion's token ids."""

    prompt_ids: list[int]
    completion_ids: list[int]
    image_inputs: dict[str, torch.Tensor] | None = None


@dataclass
class VisionPair:
    """A preference pair on an image prompt: the prompt turns, their images, the chosen and the rejected reply."""

    prompt: list[dict[str, Any]]
    images: list[Image.Image]
    chosen: str
    rejected: str


def _join_images(rows: Sequence[dict[str, torch.Tensor] | None], device: torch.device, dtype: torch.dtype
                 ) -> dict[str, torch.Tensor]:
    present = [row for row in rows if row]
    if not present:
        return {}
    joined = {}
    for key in present[0]:
        value = torch.cat([row[key] for row in present]).to(device)
        joined[key] = value.to(dtype) if value.is_floating_point() else value
    return joined


def completion_logprobs(model: torch.nn.Module, sequences: Sequence[ImageSequence], *, temperature: float = 1.0,
                        pad_id: int = 0) -> list[torch.Tensor]:
    """Per sequence, the log-probs of its completion tokens (a tensor of their number; with grad when enabled)."""
    parameter = next(model.parameters())
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in sequences]
    width = max(lengths)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, (sequence, length) in enumerate(zip(sequences, lengths)):
        ids[row, :length] = torch.tensor(sequence.prompt_ids + sequence.completion_ids)
        mask[row, :length] = 1
    ids, mask = ids.to(parameter.device), mask.to(parameter.device)
    images = _join_images([s.image_inputs for s in sequences], parameter.device, parameter.dtype)
    types = multimodal_token_types(model, ids) if images else None
    if types is not None:  # Qwen2-VL's M-RoPE finds the image tokens by their type: its processor's, from the ids
        images["mm_token_type_ids"] = types
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False, **images).logits
    out = []
    for row, sequence in enumerate(sequences):
        start, count = len(sequence.prompt_ids), len(sequence.completion_ids)
        scored = logits[row, start - 1 : start - 1 + count].float()
        out.append(target_logprobs(scored, ids[row, start : start + count], temperature))
    return out


def _rows(processor: Any, samples: Sequence[VisionSample]) -> list[dict[str, torch.Tensor]]:
    return [vision_inputs(processor, sample.messages, sample.images) for sample in samples]


def vision_sft_loss(model: torch.nn.Module, processor: Any, samples: Sequence[VisionSample]) -> torch.Tensor:
    """Mean cross-entropy over the assistant tokens of `samples` (one batch)."""
    return _rows_loss(model, _rows(processor, samples), processor.tokenizer.pad_token_id)


def _rows_loss(model: torch.nn.Module, rows: Sequence[dict[str, torch.Tensor]], pad_id: int) -> torch.Tensor:
    return model(**_device_batch(model, rows, pad_id)).loss


def _device_batch(model: torch.nn.Module, rows: Sequence[dict[str, torch.Tensor]], pad_id: int
                  ) -> dict[str, torch.Tensor]:
    """`rows` collated on the model's device, image tensors in its dtype."""
    parameter = next(model.parameters())
    batch = {key: value.to(parameter.device) for key, value in collate_vision(rows, pad_id).items()}
    for key, value in batch.items():
        if key not in TEXT_KEYS and value.is_floating_point():
            batch[key] = value.to(parameter.dtype)
    return batch


def vision_loss_sum(model: torch.nn.Module, rows: Sequence[dict[str, torch.Tensor]], pad_id: int
                    ) -> tuple[torch.Tensor, int]:
    """The cross-entropy summed over the labelled (assistant) tokens of `rows` (fp32) and their number: token
    t's label is scored by the logits at t - 1, as the model's own loss does, summed instead of averaged so a
    step of several micro-batches can divide by its whole token count."""
    batch = _device_batch(model, rows, pad_id)
    labels = batch.pop("labels")
    logits = model(**batch, use_cache=False).logits[:, :-1].float()
    targets = labels[:, 1:]
    summed = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                               ignore_index=IGNORE_INDEX, reduction="sum")
    return summed, int((targets != IGNORE_INDEX).sum())


def pair_sequences(processor: Any, pair: VisionPair) -> tuple[ImageSequence, ImageSequence]:
    """The pair's two replies as image sequences: the full chat's ids split at the prompt's rendered length."""
    sequences = []
    for reply in (pair.chosen, pair.rejected):
        row = vision_inputs(processor, pair.prompt + [{"role": "assistant", "content": reply}], pair.images)
        ids, labels = row["input_ids"][0], row["labels"][0]
        start = int((labels != -100).nonzero()[0])
        extra = {key: value for key, value in row.items() if key not in TEXT_KEYS}
        sequences.append(ImageSequence(ids[:start].tolist(), ids[start:].tolist(), extra or None))
    return sequences[0], sequences[1]


def vision_dpo_loss(model: torch.nn.Module, reference: torch.nn.Module, processor: Any,
                    pairs: Sequence[VisionPair], *, beta: float = 0.1) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean sigmoid DPO loss over `pairs`, and the reward accuracy (chosen's implicit reward above rejected's)."""
    sequences = [s for pair in pairs for s in pair_sequences(processor, pair)]
    return _pairs_loss(model, reference, sequences, processor.tokenizer.pad_token_id, beta)


def _pairs_loss(model: torch.nn.Module, reference: torch.nn.Module, sequences: Sequence[ImageSequence], pad: int,
                beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    """`vision_dpo_loss` on the pairs' sequences, chosen and rejected alternating."""
    policy = torch.stack([lp.sum() for lp in completion_logprobs(model, sequences, pad_id=pad)])
    with torch.no_grad():
        ref = torch.stack([lp.sum() for lp in completion_logprobs(reference, sequences, pad_id=pad)])
    losses = dpo_loss(policy[0::2], policy[1::2], ref[0::2], ref[1::2], beta=beta)
    margin = (policy[0::2] - ref[0::2]) - (policy[1::2] - ref[1::2])
    return losses.mean(), {"reward_accuracy": float((margin > 0).float().mean()), "margin": float(margin.mean())}


@dataclass
class VisionTrainResult:
    losses: list[float] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)


def _batches(count: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """`steps` batches of indices, epochs shuffled with `seed`."""
    rng, order, out = random.Random(seed), [], []
    for _ in range(steps):
        batch = []
        while len(batch) < min(batch_size, count):
            if not order:
                order = list(range(count))
                rng.shuffle(order)
            batch.append(order.pop())
        out.append(batch)
    return out


def run_vision_sft(model: torch.nn.Module, processor: Any, samples: Sequence[VisionSample], *, steps: int,
                   lr: float = 3e-3, batch_size: int = 8, seed: int = 0, max_grad_norm: float = 1.0,
                   warmup_steps: int = 0) -> VisionTrainResult:
    """`steps` AdamW steps of `vision_sft_loss` over shuffled batches of `samples`; the model trains in place.
    The learning rate rises linearly over `warmup_steps`, then stays at `lr`. Each chat goes through the processor
    once, before the first step."""
    rows = _rows(processor, samples)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = build_scheduler(optimizer, OptimConfig(lr=lr, warmup_steps=warmup_steps, schedule="constant"), steps)
    result = VisionTrainResult()
    model.train()
    for batch in _batches(len(samples), batch_size, steps, seed):
        loss = _rows_loss(model, [rows[i] for i in batch], processor.tokenizer.pad_token_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        warmup.step()
        result.losses.append(float(loss.detach()))
    model.eval()
    return result


def run_vision_dpo(model: torch.nn.Module, reference: torch.nn.Module, processor: Any, pairs: Sequence[VisionPair],
                   *, steps: int, lr: float = 1e-3, beta: float = 0.1, batch_size: int = 8, seed: int = 0,
                   max_grad_norm: float = 1.0) -> VisionTrainResult:
    """`steps` AdamW steps of `vision_dpo_loss` against the frozen `reference`; the model trains in place.
    Each pair goes through the processor once, before the first step."""
    sequences = [pair_sequences(processor, pair) for pair in pairs]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    reference.eval()
    result = VisionTrainResult()
    model.train()
    for batch in _batches(len(pairs), batch_size, steps, seed):
        chosen_rejected = [s for i in batch for s in sequences[i]]
        loss, metrics = _pairs_loss(model, reference, chosen_rejected, processor.tokenizer.pad_token_id, beta)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        result.losses.append(float(loss.detach()))
        result.metrics.append(metrics)
    model.eval()
    return result


def start_vision_run(recipe: Any, read: Callable[..., Any], stage: str,
                     resume: bool) -> tuple[Path, Runtime, Any, torch.nn.Module, Any]:
    """What the `sft` and `dpo` recipes' image paths start with: the run directory (with the resolved recipe), the
    runtime, the data (`read(recipe.data, rejects_dir=...)`), and the policy with its processor. With `model.path`
    unset the policy is the built-in tiny VLM, its tokenizer trained on the data's text."""
    output_dir = open_run_dir(recipe, stage, resume)
    runtime = setup_runtime(recipe.runtime)
    data = read(recipe.data, rejects_dir=output_dir)
    tokenizer = None
    if recipe.model.path is None:
        tokenizer = load_tokenizer(recipe.model, corpus=vision_texts(data.train + data.heldout))
    model, processor = load_vision_policy(recipe.model, tokenizer, runtime.device)
    return output_dir, runtime, data, model, processor
