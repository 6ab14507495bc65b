"""Where the RL policy trains and where its rollouts come from: the `RLBackend` seam.

`run_rl` uses `local_backend`: the model, its optimizer and schedule in this process (`rl.update.LocalPolicy`), an
`HFEngine` holding its own copy of the weights beside it (`make_engine`; on a CPU the two share the cores:
`split_cpu_threads`), rollouts on the pipeline's producer thread. `posttrain.distributed` builds another backend
(engine actors, an FSDP trainer group) and the loop in `rl.trainer` stays the same.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch

from posttrain.config import RLRecipe
from posttrain.models import is_lora, merged_copy
from posttrain.rl.pipeline import RolloutFn, engine_rollout
from posttrain.rl.update import LocalPolicy, PolicyTrainer
from posttrain.train import Runtime


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


def thread_budget(threads: int | None) -> Callable[[], None] | None:
    if not threads:
        return None

    def setup() -> None:
        torch.set_num_threads(threads)

    return setup
