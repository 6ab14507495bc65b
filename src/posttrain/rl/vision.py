"""Image tasks in RL: what the main loop (`rl.trainer.run_rl` with ``model.vision``) needs of a vision-language
model, and a small GRPO loop of its own (`run_vision_grpo`).

For the main loop: `wants_vision` (the recipe asks for a VLM), `load_vision_policy` (the VLM and its processor),
and `ProcessorRenderer`, the `envs.PromptRenderer` the episode loop renders image prompts with (the processor's
ids and image tensors, which every turn's request and the trajectory carry to the engine and the trainer).

One step (`run_vision_grpo`; the update alone: `vision_grpo_update`), top to bottom:

    tasks       `tasks_per_step` image tasks drawn from the sampler (a function of the step)
    rollouts    `group_size` answers per task from the built-in engine on image prompts
                (`posttrain.evaluate.sample_image_tasks`: token ids and behaviour log-probs exactly as sampled)
    rewards     each task's own verifier (the eval's judge)
    advantages  group-relative, A = (r - mean(group)) / (std(group) + eps) (`rl.advantages.compute_advantages`);
                groups whose answers all scored alike carry no signal and are dropped
    update      the clipped surrogate (`train.clipped_policy_loss`, token-level ratio, token mean) on the trainer's
                log-probs of the sampled tokens with the images (`train.vision.completion_logprobs`), one AdamW step
    weights     the new weights copied into the engine (`update_weights`, version = step)

On-policy (one update per batch), so the ratio is 1 up to the engine/trainer gap, which the self-test bounds at
start-up (`rl.engine_trainer_self_test` with the processor: the engine samples answers to image prompts, the
trainer re-scores the same tokens with the same images). This is the single-turn image path with no KL term,
resume or guard; `posttrain rl` with ``model.vision`` runs image tasks through the main loop, which has them. A
LoRA policy (`posttrain.models.apply_lora`) trains its adapters; the engine gets the merged weights.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from posttrain.chat import IMAGE_PART_TYPES, first_image_message, render_chat
from posttrain.config import ConfigError, ModelConfig
from posttrain.data import validate_vision_record
from posttrain.envs import EnvError
from posttrain.evaluate import ImageAnswer, sample_image_tasks
from posttrain.models import build_tiny_vlm, load_processor, load_vision_model, vision_request
from posttrain.rl.advantages import compute_advantages
from posttrain.rl.backend import engine_trainer_self_test
from posttrain.rl.update import engine_state, plain_copy, scoring_temperature
from posttrain.rollout import HFEngine
from posttrain.train import ImageSequence, clipped_policy_loss, completion_logprobs
from posttrain.types import SamplingParams, Task, Trajectory

TaskSampler = Callable[[int, int], list[Task]]  # (step, count) -> tasks
_PROMPT_CACHE_SIZE = 512  # rendered image prompts kept (a group's episodes share one)


# ---- images in the main RL loop: the policy and its processor, the episode loop's prompt renderer ----------------

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
    """The RL policy as a vision-language model and its processor: `model.path` (`models.load_vision_model`), or the
    built-in tiny VLM (`models.build_tiny_vlm`, the `model.preset` text model) for `tokenizer` (a fresh run's)."""
    if model.lora.enabled:
        raise ConfigError("model.lora: LoRA on a vision-language model is not supported yet (docs/multimodal.md)")
    if model.rope_scaling is not None:
        raise ConfigError("model.rope_scaling: not supported with model.vision")
    if model.path is None:
        policy, processor = build_tiny_vlm(tokenizer, preset=model.preset, seed=model.seed)
        return policy.to(device), processor
    return load_vision_model(model.path, dtype=model.dtype, device=device)


def policy_processor(model: ModelConfig, tokenizer: Any) -> Any:
    """The processor `load_vision_policy` would give, without loading the weights (`posttrain validate`)."""
    if model.path is None:
        return build_tiny_vlm(tokenizer, preset=model.preset, seed=model.seed)[1]
    return load_processor(model.path)


class ProcessorRenderer:
    """The episode loop's `envs.PromptRenderer` for a vision-language model: a task's prompt (image parts as
    ``image_url``/``image`` parts, e.g. a ``data:`` URL) read with `data.validate_vision_record` and turned into ids
    and image tensors by the model's processor (`models.vision_request`, as the self-test and `run_vision_grpo`
    do); transcripts rendered by the processor's template (`chat.render_chat` with ``images=True``). Rendered
    prompts are cached (a GRPO group shares one: its members share the tensors, read only)."""

    def __init__(self, processor: Any):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self._cache: OrderedDict[str, tuple[list[int], dict[str, Any] | None]] = OrderedDict()
        self._lock = threading.Lock()

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], dict[str, Any] | None]:
        if tools or template_kwargs:
            raise EnvError("an image prompt takes no tools or chat-template arguments yet (the processor renders it)")
        key = json.dumps(messages, sort_keys=True, default=str)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                ids, images = self._cache[key]
                return list(ids), images
        sample = validate_vision_record({"messages": messages}, require_assistant=False)
        request = vision_request(self.processor, sample.messages, sample.images)
        with self._lock:
            self._cache[key] = (request.prompt_token_ids, request.image_inputs)
            if len(self._cache) > _PROMPT_CACHE_SIZE:
                self._cache.popitem(last=False)
        return list(request.prompt_token_ids), request.image_inputs

    def render(self, messages: list[dict[str, Any]], *, generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        return render_chat(self.processor, [_placeholders(m) for m in messages], generation_prompt=generation_prompt,
                           tools=tools, template_kwargs=template_kwargs, images=True)

    def attach(self, trajectories: Sequence[Trajectory]) -> int:
        """Render again the image tensors of trajectories that hold image parts but lost their tensors (a batch
        restored from a checkpoint keeps the images' reference, not the pixels); returns how many."""
        restored = 0
        for trajectory in trajectories:
            if trajectory.image_inputs is None and first_image_message(trajectory.messages) is not None:
                prompt = _prompt_turns(trajectory.messages)
                trajectory.image_inputs = self.prompt(prompt)[1]
                restored += 1
        return restored


def _placeholders(message: dict[str, Any]) -> dict[str, Any]:
    """`message` as `data.validate_vision_record` writes it for the processor (text parts; each image part a bare
    ``{"type": "image"}``), without decoding its images."""
    content = message.get("content")
    if isinstance(content, str) or content is None:
        parts = [{"type": "text", "text": content or ""}]
    else:
        parts = [{"type": "image"} if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
                 else {"type": "text", "text": part if isinstance(part, str) else part.get("text", "")}
                 for part in content]
    return {**message, "content": parts}


def _prompt_turns(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    for index, message in enumerate(messages):
        if message.get("role") == "assistant":
            return list(messages[:index])
    return list(messages)


def image_engine(model: torch.nn.Module, processor: Any, *, version: int = 0) -> HFEngine:
    """The built-in engine on a plain copy of `model` (a LoRA policy merged; the trainer keeps the original),
    generic runner."""
    return HFEngine(plain_copy(model), processor.tokenizer, runner="generic", policy_version=version)


def _sequences(answers: Sequence[ImageAnswer]) -> list[ImageSequence]:
    return [ImageSequence(a.prompt_ids, a.completion.token_ids, a.image_inputs) for a in answers]


@dataclass
class VisionGRPOResult:
    steps: list[dict[str, float]] = field(default_factory=list)
    self_test: dict[str, float] = field(default_factory=dict)


def run_vision_grpo(model: torch.nn.Module, processor: Any, sample_tasks: TaskSampler, *, steps: int,
                    tasks_per_step: int = 8, group_size: int = 8, lr: float = 1e-3, temperature: float = 1.0,
                    max_new_tokens: int = 6, clip: float = 0.2, max_grad_norm: float = 1.0, seed: int = 0,
                    log: Callable[[dict[str, float]], None] | None = None) -> VisionGRPOResult:
    """`steps` GRPO steps on image tasks; `model` trains in place. See the module docstring."""
    random.seed(seed)
    torch.manual_seed(seed)
    engine = image_engine(model, processor)
    result = VisionGRPOResult()
    result.self_test = engine_trainer_self_test(engine, model, processor.tokenizer, sample_tasks(-1, 4),
                                                temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                                                processor=processor)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps):
        started = time.perf_counter()
        tasks = sample_tasks(step, tasks_per_step)
        sampling = SamplingParams(n=group_size, max_new_tokens=max_new_tokens, temperature=temperature,
                                  seed=seed * 100_003 + step)
        answers = [a for group in sample_image_tasks(engine, processor, tasks, sampling) for a in group]
        figures = {"step": step, **vision_grpo_update(model, optimizer, answers, temperature=temperature, clip=clip,
                                                      max_grad_norm=max_grad_norm,
                                                      pad_id=processor.tokenizer.pad_token_id)}
        if figures["trained_sequences"]:
            engine.update_weights(engine_state(model), version=step + 1)  # LoRA: merged
        figures["step_s"] = time.perf_counter() - started
        result.steps.append(figures)
        if log is not None:
            log(figures)
    return result


def vision_grpo_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, answers: Sequence[ImageAnswer], *,
                       temperature: float = 1.0, clip: float = 0.2, max_grad_norm: float = 1.0, pad_id: int = 0
                       ) -> dict[str, float]:
    """One optimizer step of the clipped surrogate on `answers` (groups by task id, rewards from their verifiers,
    behaviour log-probs as sampled); answers whose group scored alike are left out. Returns the step's figures
    (no step when nothing is left: ``trained_sequences`` 0)."""
    rewards = [a.reward.score for a in answers]
    advantages = compute_advantages(rewards, [a.task.id for a in answers])
    kept = [i for i, (a, adv) in enumerate(zip(answers, advantages)) if adv != 0.0 and a.completion.token_ids]
    figures: dict[str, float] = {"reward_mean": sum(rewards) / max(1, len(rewards)), "trained_sequences": len(kept)}
    if not kept:
        return figures
    model.train()
    sequences = _sequences([answers[i] for i in kept])
    logprobs = completion_logprobs(model, sequences, temperature=scoring_temperature(temperature), pad_id=pad_id)
    counts = [len(s.completion_ids) for s in sequences]
    seq_index = torch.repeat_interleave(torch.arange(len(kept)), torch.tensor(counts))
    old = torch.tensor([lp for i in kept for lp in answers[i].completion.logprobs])
    token_advantages = torch.tensor([advantages[i] for i in kept])[seq_index]
    loss, stats = clipped_policy_loss(torch.cat(logprobs), old, token_advantages, seq_index, len(kept),
                                      clip_low=clip, clip_high=clip)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    model.eval()
    figures.update(loss=float(loss.detach()), **{key: float(value) for key, value in stats.items()
                                                 if isinstance(value, (int, float))})
    return figures
