"""Where the RL policy trains and where its rollouts come from: the `RLBackend` seam.

`run_rl` uses `local_backend`: the model, its optimizer and schedule in this process (`LocalPolicy`), an
`HFEngine` holding its own copy of the weights beside it, rollouts on the pipeline's producer thread.
`posttrain.distributed` builds another backend (engine actors, an FSDP trainer group) and the loop in
`rl.trainer` stays the same. Also here: what an engine is served (`engine_state`: the merged weights of a
LoRA policy) and the reference policy for the KL term (`make_reference`: the adapter switched off under
LoRA, a frozen copy otherwise), the replay SFT loss the forgetting guard adds to an update
(`replay_sft_backward`: its gradient is accumulated before the RL update and the RL update's optimizer step takes
both) and the learning-rate scale a rollback leaves (`set_lr_scale`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from posttrain.config import RLRecipe
from posttrain.data import Row, SFTSample, collate, tokenize_samples
from posttrain.models import is_lora, load_weights_from_checkpoint, merged_copy, reference_mode
from posttrain.rl.pipeline import RolloutFn, engine_rollout
from posttrain.rl.step import UpdateSettings, rl_update, train_temperature
from posttrain.train import (
    DataParallel,
    LOCAL,
    Runtime,
    build_optimizer,
    build_scheduler,
    load_optimizer_state,
    optimizer_step,
    scored_token_stats,
    sft_loss_sum,
)
from posttrain.types import Trajectory


class PolicyTrainer(Protocol):
    """Where the policy's weights are trained: `LocalPolicy` here, an FSDP trainer group in `posttrain.distributed`."""

    def update(self, trajectories: list[Trajectory], advantages: list[float] | list[list[float]], replay: list | None
               ) -> dict[str, float]:
        """One batch's optimizer step(s); metrics named as the run logs them (``train/*``, ``guard/replay_*``).
        An advantage per trajectory, or one per policy token of it (PPO with a critic; see `rl.step`)."""
        ...

    def weights(self, copy: bool = False) -> Any:
        """The weights the engines get for the current version (a state dict, or a handle their owner takes)."""
        ...

    def full_model(self) -> torch.nn.Module:
        """The whole policy in this process, up to date: checkpoints, evaluation and the self-test read it."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer": ..., "scheduler": ...}`` in one process's format, for the checkpoint."""
        ...

    def load_checkpoint(self, checkpoint: Path, state: dict[str, Any]) -> None: ...

    def set_lr_scale(self, scale: float) -> None: ...

    def close(self) -> None: ...


@dataclass
class RLBackend:
    """What the RL loop runs on: the trainer; the engine(s) behind the InferenceEngine contract (weights by
    version, and the self-test's generate); the rollout function the batch producer calls; the setup of the
    producer thread (None when rollouts run in other processes); and what to close at the end."""

    policy: PolicyTrainer
    engine: Any
    rollout: RolloutFn
    thread_setup: Callable[[], None] | None = None
    close: Callable[[], None] | None = None


# make_backend(recipe, runtime, tokenizer, model) -> the backend; `model` is the loaded, prepared policy
BackendFactory = Callable[[RLRecipe, Runtime, Any, torch.nn.Module], RLBackend]


def local_backend(recipe: RLRecipe, runtime: Runtime, tokenizer, model: torch.nn.Module) -> RLBackend:
    """The policy trained in this process, rollouts from an HF engine beside it on the producer thread."""
    threads_before = torch.get_num_threads()
    engine_threads = split_cpu_threads(recipe, runtime)
    engine = make_engine(model, tokenizer, runtime, recipe, num_threads=engine_threads)
    return RLBackend(LocalPolicy(model, tokenizer, runtime, recipe), engine, engine_rollout(engine, tokenizer, recipe),
                     thread_setup=thread_budget(engine_threads), close=lambda: torch.set_num_threads(threads_before))


def split_cpu_threads(recipe: RLRecipe, runtime: Runtime) -> int | None:
    """The engine's torch threads on a CPU, and (rollouts overlapping training) the trainer's share.

    Two sides each running torch on all cores oversubscribe them: OpenMP threads spin against each other and
    both slow down many times over (measured here: ~50x for sampling). With `max_staleness > 0`, unless the
    recipe sets them, the engine gets half the cores (rounded down, at least one) and the trainer the rest.
    Synchronous (`max_staleness: 0`), rollouts and training take turns on the trainer's thread (the producer
    runs inline and the batcher samples on its loop's thread, `AsyncBatcher(inline=True)`): both use every core.
    Returns the engine's threads (None: the calling thread's).

    The split follows the recipe (`max_staleness`), not whether a producer thread actually runs: the number
    of threads changes the order of float reductions, and an inline run (`pipeline.overlap: false`) must
    compute bit for bit what the overlapped run computes.
    """
    if runtime.device.type != "cpu" or recipe.pipeline.max_staleness == 0:
        return recipe.rollout.engine_threads
    cores = recipe.runtime.num_threads or torch.get_num_threads()
    engine_threads = recipe.rollout.engine_threads or max(1, cores // 2)
    if recipe.runtime.num_threads is None:
        torch.set_num_threads(max(1, cores - engine_threads))
    return engine_threads


class LocalPolicy:
    """The policy, its optimizer and schedule (and the reference, when the KL term is on) in this process.

    A data-parallel rank (`posttrain.distributed`) runs the same with its sharded model and its `DataParallel`."""

    def __init__(self, model: torch.nn.Module, tokenizer, runtime: Runtime, recipe: RLRecipe, *,
                 parallel: DataParallel = LOCAL, replay_scale: float = 1.0, reference=None):
        self.model, self.tokenizer, self.runtime, self.recipe = model, tokenizer, runtime, recipe
        self.parallel, self.replay_scale = parallel, replay_scale
        if reference is None and recipe.algorithm.kl_coef > 0:
            reference = make_reference(model, recipe, runtime)
        self.reference = reference
        self.optimizer = build_optimizer(model, recipe.optim)
        self.scheduler = build_scheduler(self.optimizer, recipe.optim,
                                         recipe.train.max_steps * recipe.train.updates_per_batch)
        self.base_lrs = list(self.scheduler.base_lrs)
        self.settings = UpdateSettings.of(recipe, runtime, tokenizer.pad_token_id)

    def update(self, trajectories: list[Trajectory], advantages: list[float] | list[list[float]], replay: list | None
               ) -> dict[str, float]:
        recipe, model = self.recipe, self.model
        metrics: dict[str, float] = {}
        if replay:
            guard = recipe.schedule.guard
            # Accumulated first: the RL update's optimizer step then applies both losses' gradients together.
            # Data-parallel ranks each take the whole replay batch; `replay_scale` (1 / ranks) keeps the sum.
            metrics.update(replay_sft_backward(model, replay, self.tokenizer, self.runtime,
                                               coef=guard.replay_coef * self.replay_scale,
                                               max_length=guard.replay_max_length, reasoning=guard.replay_reasoning,
                                               micro_batch_size=recipe.train.micro_batch_size))
        stats = rl_update(model, self.optimizer, self.scheduler, trajectories, advantages, self.settings,
                          reference=self.reference, parallel=self.parallel) if trajectories else {}
        if not trajectories and "guard/replay_loss" in metrics:
            self.parallel.reduce_gradients(model)
            stats["grad_norm"] = optimizer_step(model, self.optimizer, self.scheduler, recipe.optim.max_grad_norm)
        metrics.update({f"train/{k}": v for k, v in stats.items()})
        metrics["train/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def weights(self, copy: bool = False) -> dict[str, torch.Tensor]:
        return engine_state(self.model, copy=copy)

    def full_model(self) -> torch.nn.Module:
        return self.model

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_checkpoint(self, checkpoint: Path, state: dict[str, Any]) -> None:
        load_weights_from_checkpoint(self.model, checkpoint)
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def set_lr_scale(self, scale: float) -> None:
        set_lr_scale(self.optimizer, self.scheduler, self.base_lrs, scale)

    def close(self) -> None:
        pass


def engine_state(model: torch.nn.Module, copy: bool = False) -> dict[str, torch.Tensor]:
    """The weights an engine serves: the merged model for LoRA; detached (cloned when the trainer will keep
    updating them while the engine still needs this version)."""
    from posttrain.rollout import state_for_engine

    state = state_for_engine(model)
    return {k: v.detach().clone() for k, v in state.items()} if copy else state


def make_engine(model, tokenizer, runtime: Runtime, recipe: RLRecipe, num_threads: int | None = None):
    if recipe.rollout.engine == "vllm":
        from posttrain.rollout import VLLMEngine

        return VLLMEngine(recipe.model.path, tokenizer=tokenizer)
    from posttrain.rollout import HFEngine, load_speculation

    engine_model = merged_copy(model) if is_lora(model) else copy.deepcopy(model)
    for parameter in engine_model.parameters():
        parameter.requires_grad_(False)
    spec = recipe.rollout.speculative
    return HFEngine(engine_model, tokenizer, autocast=runtime.autocast_dtype,
                    max_batch_size=recipe.rollout.engine_batch_size, num_threads=num_threads,
                    compile=recipe.runtime.compile,
                    speculative=load_speculation(spec.draft, tokenizer, num_tokens=spec.num_tokens, ngram=spec.ngram))


def make_reference(model, recipe: RLRecipe, runtime: Runtime):
    """log-probs of the scored tokens under the reference policy: the base with the adapter off (LoRA), or a
    frozen copy of the starting weights."""
    temperature = train_temperature(recipe)
    if is_lora(model):
        def lora_reference(input_ids, attention_mask, score_mask):
            with reference_mode(model):
                return scored_token_stats(model, input_ids, score_mask, input_ids[:, 1:][score_mask],
                                          temperature=temperature, attention_mask=attention_mask).logprobs

        return lora_reference
    frozen = copy.deepcopy(model).eval()
    for parameter in frozen.parameters():
        parameter.requires_grad_(False)

    def copy_reference(input_ids, attention_mask, score_mask):
        return scored_token_stats(frozen, input_ids, score_mask, input_ids[:, 1:][score_mask],
                                  temperature=temperature, attention_mask=attention_mask).logprobs

    return copy_reference


def thread_budget(threads: int | None) -> Callable[[], None] | None:
    if not threads:
        return None

    def setup() -> None:
        torch.set_num_threads(threads)

    return setup


def replay_sft_backward(model: torch.nn.Module, samples: list[SFTSample], tokenizer, runtime: Runtime, *,
                        coef: float, max_length: int, reasoning: str, micro_batch_size: int) -> dict[str, float]:
    """Accumulate ``coef * mean token cross-entropy`` over the replay demonstrations into the gradients (the
    caller's optimizer step applies it together with the RL loss)."""
    tokenized = tokenize_samples(samples, tokenizer, max_length, reasoning).samples
    if not tokenized:
        return {}
    rows = [Row(s.input_ids, s.loss_mask, list(range(len(s))), [0] * len(s)) for s in tokenized]
    batches = [collate(rows[i : i + micro_batch_size], tokenizer.pad_token_id, device=runtime.device)
               for i in range(0, len(rows), micro_batch_size)]
    trained = sum(int((batch["labels"] != -100).sum()) for batch in batches)
    if trained == 0:
        return {}
    model.train()
    total = 0.0
    for batch in batches:
        with runtime.autocast():
            summed, _ = sft_loss_sum(model, batch)
        (coef * summed / trained).backward()
        total += float(summed.detach())
    return {"guard/replay_loss": total / trained, "guard/replay_tokens": float(trained),
            "guard/replay_samples": float(len(rows))}


def set_lr_scale(optimizer: torch.optim.Optimizer, scheduler, base_lrs: list[float], scale: float) -> None:
    """Scale the learning rate of a `LambdaLR` schedule from now on (the schedule's shape is kept)."""
    scheduler.base_lrs = [lr * scale for lr in base_lrs]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
