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

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from posttrain.evaluate import ImageAnswer, ProcessorRenderer, sample_image_tasks  # noqa: F401 (re-exported)
from posttrain.models import load_vision_policy, policy_processor, vision_request, wants_vision  # noqa: F401 (re-exported)
from posttrain.rl.advantages import compute_advantages
from posttrain.rl.backend import engine_trainer_self_test
from posttrain.rl.update import engine_state, plain_copy, scoring_temperature
from posttrain.rollout import HFEngine
from posttrain.train import ImageSequence, clipped_policy_loss, completion_logprobs
from posttrain.types import SamplingParams, Task

TaskSampler = Callable[[int, int], list[Task]]  # (step, count) -> tasks


# ---- images in the main RL loop: the policy and its processor, the episode loop's prompt renderer ----------------

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
