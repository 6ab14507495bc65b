"""Where the RL policy trains and where its rollouts come from (the `RLBackend` seam), and the engine beside a
policy: the start-up self-test that the two run the same policy, and verified answers sampled on it.

`run_rl` uses `local_backend`: the model, its optimizer and schedule in this process (`rl.update.LocalPolicy`), an
`HFEngine` holding its own copy of the weights beside it (`make_engine`; on a CPU the two share the cores:
`split_cpu_threads`), rollouts on the pipeline's producer thread. `posttrain.distributed` builds another backend
(engine actors, an FSDP trainer group) and the loop in `rl.trainer` stays the same.

**The self-test** (`engine_trainer_self_test`): do the engine and the trainer agree on what the policy is? Before
the first step the trainer pushes its weights to the engine, samples a fixed batch, re-scores those exact tokens
with its own forward pass and compares log-probs. A gap beyond the tolerance means the two are not running the
same policy — weights that never reached the engine, a LoRA adapter left out of the pushed weights, a different
chat template or tokenizer, a numeric path far off — and the run stops before it trains on garbage. The same
comparison is logged every step (`gap_*` metrics) from the training forward. Given a vision-language model's
processor, the same test runs on image tasks (`rl.vision.run_vision_grpo`): prompts rendered by the processor with
their images, the trainer's forward fed the same image tensors as the engine's prefill. The default tolerance follows
the precision in use (`train.forward.logprob_tolerance`): 1e-3 in fp32; in bf16 a few bf16 epsilons per unit of the
largest |logit|, from the noise measured between two bf16 forwards of the same model — not a flat allowance that
would also pass a different function (a missing soft-cap).

**Verified answers to task prompts** (`EngineAnswerSampler`): the `train.AnswerSampler` the distillation recipe
is given (it sits below `rollout` and `tasks`, so it cannot build one itself).

    sampler = EngineAnswerSampler(recipe.tasks, seed=recipe.runtime.seed)
    answers = sampler(teacher, tokenizer, role="teacher", count=256, draw=0)     # list[Trajectory], verified

Each call draws `count` fresh tasks of the configured domains (spread by weight, at their levels, from `split`),
seeded by (seed, draw, domain), and runs one episode per task and sample through `envs.run_episodes`, so every
answer is judged by its task's own verifier, as in RL and eval. One `HFEngine` per role: the teacher's runs on the
teacher model itself (frozen); the student's on a copy, into which the student's current weights are pushed on
every call (version = draw), so an on-policy sample always comes from the weights being trained.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from posttrain.config import ConfigError, DistillTasksConfig, RLRecipe
from posttrain.data import prompt_ids
from posttrain.envs import run_episodes
from posttrain.evaluate import image_sample
from posttrain.models import vision_request
from posttrain.rl.pipeline import RolloutFn, engine_rollout
from posttrain.rl.update import LocalPolicy, PolicyTrainer, plain_copy, scoring_temperature
from posttrain.rollout import HFEngine, VLLMEngine, load_speculation, state_for_engine
from posttrain.tasks import TaskError, get_domain, sample_tasks
from posttrain.train import Runtime, logprob_gap_stats, logprob_tolerance, selected_logits, target_logprobs
from posttrain.types import Completion, GenerationRequest, PosttrainError, SamplingParams, Task, Trajectory


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


def local_backend(recipe: RLRecipe, runtime: Runtime, tokenizer, model: torch.nn.Module, *,
                  renderer: Any = None) -> RLBackend:
    """The policy trained in this process, rollouts from an HF engine beside it on the producer thread (image
    prompts through `renderer`, an `envs.PromptRenderer`, when the policy is a vision-language model)."""
    threads_before = torch.get_num_threads()
    engine_threads = split_cpu_threads(recipe, runtime)
    engine = make_engine(model, tokenizer, runtime, recipe, num_threads=engine_threads)
    rollout = engine_rollout(engine, tokenizer, recipe, renderer)
    return RLBackend(LocalPolicy(model, tokenizer, runtime, recipe), engine, rollout,
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
        return VLLMEngine(recipe.model.path, tokenizer=tokenizer)
    engine_model = plain_copy(model)
    for parameter in engine_model.parameters():
        parameter.requires_grad_(False)
    spec = recipe.rollout.speculative
    if is_vision_model(model):
        # Image prompts: the generic runner feeds the image tensors to the prefill (the fast decoder and speculative
        # decoding take text only).
        if spec.draft is not None:
            raise ConfigError("rollout.speculative: speculative decoding takes text prompts only; unset "
                                "rollout.speculative.draft for a vision-language policy")
        return HFEngine(engine_model, tokenizer, autocast=runtime.autocast_dtype, runner="generic",
                        max_batch_size=recipe.rollout.engine_batch_size, num_threads=num_threads)
    return HFEngine(engine_model, tokenizer, autocast=runtime.autocast_dtype,
                    max_batch_size=recipe.rollout.engine_batch_size, num_threads=num_threads,
                    compile=recipe.runtime.compile is True,  # "auto" is decided in run_rl_on
                    share_prompts=recipe.rollout.share_prompts, prepack_weights=recipe.rollout.prepack_weights,
                    speculative=load_speculation(spec.draft, tokenizer, num_tokens=spec.num_tokens, ngram=spec.ngram))


def is_vision_model(model: torch.nn.Module) -> bool:
    """A vision-language model (its config has a ``vision_config``)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def thread_budget(threads: int | None) -> Callable[[], None] | None:
    if not threads:
        return None

    def setup() -> None:
        torch.set_num_threads(threads)

    return setup


# ---- the start-up self-test: the engine and the trainer run the same policy -----------------------------------------

class SelfTestError(PosttrainError):
    """The engine and the trainer disagree about the policy's log-probs."""


@torch.no_grad()
def engine_trainer_self_test(
    engine: Any,
    model: torch.nn.Module,
    tokenizer: Any,
    tasks: Sequence[Task],
    runtime: Runtime | None = None,
    *,
    temperature: float,
    max_new_tokens: int,
    tolerance: float | None = None,
    seed: int = 0,
    processor: Any = None,
) -> dict[str, float]:
    """Sample `tasks` with the engine, re-score with the trainer; raise `SelfTestError` past `tolerance`.

    With a vision-language model's `processor`, `tasks` are image tasks: each prompt goes through the processor with
    its images (`models.vision_request`), and the trainer's forward gets the same image tensors the engine's prefill
    got. `runtime` None: the model's device, no autocast.
    """
    requests = _self_test_requests(tokenizer, tasks, processor)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    completions = [group[0] for group in engine.generate(requests, sampling)]
    was_training = model.training
    model.eval()
    trainer, behaviour, top = _rescore(model, requests, completions, runtime, scoring_temperature(temperature))
    model.train(was_training)
    what = "self-test" if processor is None else "image self-test"
    if not trainer:
        raise SelfTestError(f"{what}: the engine returned no tokens for the test prompts")
    stats = logprob_gap_stats(torch.cat(trainer).float(), torch.cat(behaviour).float())
    autocast_dtype = runtime.autocast_dtype if runtime is not None else None
    tolerance = tolerance if tolerance is not None else logprob_tolerance(autocast_dtype, top)
    if stats["gap_abs_max"] > tolerance:
        hint = ("). Set pipeline.self_test_tolerance to accept a larger numeric gap." if processor is None else
                " another processor? the images not fed to the prefill?). Pass `tolerance` to accept a larger gap.")
        raise SelfTestError(
            f"{what}: engine and trainer log-probs differ by up to {stats['gap_abs_max']:.4g} "
            f"(mean {stats['gap_abs_mean']:.3g}, tolerance {tolerance:.3g}): the engine is not running the trainer's "
            f"policy (weights not pushed? adapter missing? a different tokenizer or chat template?{hint}"
        )
    return stats


def _rescore(model: torch.nn.Module, requests: Sequence[GenerationRequest], completions: Sequence[Completion],
             runtime: Runtime | None, temperature: float) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """The trainer's log-probs of each completion's tokens (one forward per sequence, with the request's image
    tensors), the engine's for the same tokens, and the largest |logit| seen (the bf16 tolerance scales with it)."""
    parameter = next(model.parameters())
    device = runtime.device if runtime is not None else parameter.device
    autocast = runtime.autocast if runtime is not None else contextlib.nullcontext
    trainer, behaviour, top = [], [], 0.0
    for request, completion in zip(requests, completions):
        if not completion.token_ids:
            continue
        prompt = request.prompt_token_ids
        ids = torch.tensor([prompt + completion.token_ids], device=device)
        select = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool, device=device)
        select[0, len(prompt) - 1 :] = True
        images = {key: value.to(device, parameter.dtype if value.is_floating_point() else value.dtype)
                  for key, value in (request.image_inputs or {}).items()}
        # Eager even when the decoder is compiled: one sequence at a time, without gradients, is a graph of its own
        # (batch 1 is specialized), one more compile (~10-20 CPU-s on 2 cores) for 8 forwards. The compiled forward
        # equals the eager one to float tolerance (tests/test_compile_default.py).
        with torch.compiler.set_stance("force_eager"), autocast():
            logits = selected_logits(model, ids, select, **images)
        top = max(top, float(logits.abs().max()))
        trainer.append(target_logprobs(logits, ids[0, len(prompt):], temperature))
        behaviour.append(torch.tensor(completion.logprobs, device=device))
    return trainer, behaviour, top


def _self_test_requests(tokenizer: Any, tasks: Sequence[Task], processor: Any) -> list[GenerationRequest]:
    if processor is None:
        return [GenerationRequest(p) for p in prompt_ids(tokenizer, [task.messages for task in tasks])]
    samples = [image_sample(task) for task in tasks]
    return [vision_request(processor, sample.messages, sample.images) for sample in samples]


# ---- verified answers on the built-in engine (distillation's sampler) ----------------------------------------------

class EngineAnswerSampler:
    def __init__(self, tasks: DistillTasksConfig, *, seed: int = 0, autocast: torch.dtype | None = None):
        self.config, self.seed, self.autocast = tasks, seed, autocast
        self.domains = [(spec, get_domain(spec.name, **spec.args)) for spec in tasks.domains]
        self._engines: dict[str, HFEngine] = {}

    def tasks(self, count: int, draw: int, split: str = "train") -> list[Task]:
        """`count` tasks spread over the domains by weight (largest remainders first), deterministic in the draw."""
        weights = [spec.weight for spec, _ in self.domains]
        shares = [count * w / max(sum(weights), 1e-12) for w in weights]
        counts = [int(share) for share in shares]
        for index in sorted(range(len(shares)), key=lambda i: counts[i] - shares[i])[: count - sum(counts)]:
            counts[index] += 1
        drawn: list[Task] = []
        for index, ((spec, domain), share) in enumerate(zip(self.domains, counts)):
            if not share:
                continue
            seed = self.seed * 1_000_003 + draw * 101 + index
            try:
                drawn += sample_tasks(domain, share, level=spec.levels, split=split, seed=seed)
            except TaskError:
                # Levels with fewer distinct problems than asked for (level 1 of arithmetic: ~10 held out):
                # repeats are still fresh samples of the answer, so draw with replacement.
                drawn += sample_tasks(domain, share, level=spec.levels, split=split, seed=seed, unique=False)
        return drawn

    def __call__(self, model: torch.nn.Module, tokenizer: Any, *, role: str, count: int, draw: int, n: int = 1,
                 split: str = "train") -> list[Trajectory]:
        engine = self._engine(role, model, tokenizer)
        if role == "student":
            engine.update_weights(state_for_engine(model), version=draw)
        sampling = SamplingParams(max_new_tokens=self.config.max_new_tokens, temperature=self.config.temperature,
                                  seed=self.seed * 1_000_003 + draw)
        return run_episodes(engine, self.tasks(count, draw, split), tokenizer, sampling, n=n)

    def _engine(self, role: str, model: torch.nn.Module, tokenizer: Any) -> HFEngine:
        if role not in self._engines:
            if role == "teacher":
                own = model  # frozen: the engine may share it with the loss
            else:
                own = plain_copy(model)
            self._engines[role] = HFEngine(own, tokenizer, autocast=self.autocast,
                                           max_batch_size=self.config.engine_batch_size)
        return self._engines[role]
