"""Running tasks through one engine: every episode of every suite in one event loop, batched across episodes.

One `HFEngine` per checkpoint; `AsyncBatcher` gathers the generate calls of the episodes in flight into engine
batches (`EvalRuntime.batch_size` sequences). At most `max_concurrency` episodes are in flight (default: one
batch): an episode's wall time counts from its start, so starting all of them at once would charge the queue to
each episode's `timeout_s`. The greedy episodes (pass@1) run first, then the `n` sampled ones per item (pass@k),
each a seeded stream (`SamplingParams.seed` + sample index), so a run repeats.

Threads: on a CPU the engine runs in a worker thread while the event loop tokenizes prompts and runs verifiers,
so the engine gets one core less than torch would take (`EvalRuntime.num_threads` overrides; restored after).
Oversubscribed OpenMP threads spin against each other: on a shared 2-core machine two engine threads measured
10-50x slower than one.

`SuiteEvaluator` is the same run for a model still training (the RL forgetting guard): ``evaluate(model,
version) -> {suite: SuiteScore}``, the weights copied into an engine of its own before each call.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from posttrain.config import EvalRuntime, EvalSampling, ModelConfig, RopeScalingConfig, RuntimeConfig, TierEngine
from posttrain.models import wants_vision
from posttrain.evaluate.cache import CachedItems
from posttrain.evaluate.errors import EvalError
from posttrain.evaluate.metrics import ItemEpisodes, SuiteScore
from posttrain.evaluate.suites import Suite, by_suite
from posttrain.types import SamplingParams, Task, Trajectory


@dataclass
class Policy:
    """A loaded checkpoint: the engine that samples from it and its tokenizer."""

    engine: Any
    tokenizer: Any
    path: str
    device: str = "cpu"
    renderer: Any = None  # image prompts: an `envs.PromptRenderer` (a vision-language model's processor)
    # How the checkpoint is run (device, precision, engine settings): with its files, the episode cache's key.
    # None: episodes of this policy are never cached (a model still training, a vision-language checkpoint).
    settings: dict[str, Any] | None = None


@dataclass
class RunStats:
    seconds: float
    episodes: int  # sampled in this run (not those taken from the episode cache)
    policy_tokens: int
    threads: int = 0  # torch threads the engine ran with
    cached_episodes: int = 0  # taken from the episode cache
    items_run: int = 0  # items with at least one episode sampled in this run

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / self.seconds if self.seconds > 0 else 0.0


def load_policy(path: str | Path, runtime: EvalRuntime | None = None, engine: TierEngine | None = None, *,
                rope_scaling: RopeScalingConfig | None = None) -> Policy:
    """The model and tokenizer of a local Hugging Face directory behind an `HFEngine` (built with a tier's
    `engine` settings when given: its runner, and `options` as further keyword arguments). `rope_scaling` (a
    recipe's `model.rope_scaling`) extends the model as training does, for an engine that follows a model trained
    from this directory with its context extended."""
    from posttrain.models import ModelError, autocast_dtype, load_model, load_tokenizer, resolve_device
    from posttrain.rollout import HFEngine, load_speculation

    runtime = runtime or EvalRuntime()
    config = ModelConfig(path=str(path), rope_scaling=rope_scaling)
    if wants_vision(config):
        return load_vision_checkpoint(path, runtime, engine)
    settings = RuntimeConfig(device=runtime.device, precision=runtime.precision)
    try:
        tokenizer = load_tokenizer(config)
        device = resolve_device(settings)
        model = load_model(config, tokenizer, device).eval()
    except ModelError as error:
        raise EvalError(f"checkpoint {path}: {error}") from None
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    engine = engine or TierEngine()
    reserved = sorted(set(engine.options) & {"device", "autocast", "max_batch_size", "runner", "speculative"})
    if reserved:
        raise EvalError(f"checkpoint {path}: engine.options {reserved} are set by the eval runtime / engine.runner")
    spec = engine.speculative or runtime.speculative
    try:
        speculative = load_speculation(spec.draft, tokenizer, num_tokens=spec.num_tokens, ngram=spec.ngram)
        built = HFEngine(model, tokenizer, device=device, autocast=autocast_dtype(settings, device),
                         max_batch_size=runtime.batch_size, runner=engine.runner, speculative=speculative,
                         **engine.options)
    except TypeError as error:  # an option this engine does not take
        raise EvalError(f"checkpoint {path}: engine.options: {error}") from None
    how_it_runs = {"device": device.type, "autocast": str(autocast_dtype(settings, device)),
                   "engine": engine.model_dump(mode="json"), "speculative": spec.model_dump(mode="json"),
                   "rope_scaling": rope_scaling.model_dump(mode="json") if rope_scaling else None}
    return Policy(built, tokenizer, str(path), device.type, settings=how_it_runs)


def load_vision_checkpoint(path: str | Path, runtime: EvalRuntime, engine: TierEngine | None = None) -> Policy:
    """A vision-language checkpoint (`models.load_vision_model`: its processor beside the weights) behind the
    built-in engine's generic runner, with the processor as the episode loop's prompt renderer
    (`evaluate.images.ProcessorRenderer`), so image tasks are sampled with their images."""
    from posttrain.evaluate.images import ProcessorRenderer
    from posttrain.models import ModelError, autocast_dtype, load_vision_model, resolve_device
    from posttrain.rollout import HFEngine

    engine = engine or TierEngine()
    if engine.speculative or runtime.speculative.draft or engine.options or engine.runner == "fast":
        raise EvalError(f"checkpoint {path}: a vision-language model runs on the engine's generic runner, without "
                        "speculative decoding or engine options")
    settings = RuntimeConfig(device=runtime.device, precision=runtime.precision)
    try:
        device = resolve_device(settings)
        model, processor = load_vision_model(str(path), device=device)
    except ModelError as error:
        raise EvalError(f"checkpoint {path}: {error}") from None
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    built = HFEngine(model, processor.tokenizer, device=device, autocast=autocast_dtype(settings, device),
                     max_batch_size=runtime.batch_size, runner="generic")
    return Policy(built, processor.tokenizer, str(path), device.type, renderer=ProcessorRenderer(processor))


def run_items(policy: Policy, tasks: Sequence[Task], sampling: EvalSampling | None = None,
              runtime: EvalRuntime | None = None) -> tuple[list[ItemEpisodes], RunStats]:
    """Every task's greedy episode and `sampling.n` sampled ones; items in task order. With
    `runtime.episode_cache` set, an item's episodes already sampled for this checkpoint come from the cache and
    only the rest are sampled (`posttrain.evaluate.cache`)."""
    sampling = sampling or EvalSampling()
    runtime = runtime or EvalRuntime()
    tasks = [_scaled(task, runtime.timeout_scale) for task in tasks]
    cached = CachedItems.open(runtime.episode_cache, policy.path, policy.settings, sampling, tasks)
    greedy_todo = [i for i in range(len(tasks)) if sampling.greedy and cached.greedy[i] is None]
    sampled_todo = [i for i in range(len(tasks)) if sampling.n and cached.sampled[i] is None]
    with engine_threads(policy, runtime) as threads:
        started = time.perf_counter()
        greedy, samples = asyncio.run(_collect(policy, [tasks[i] for i in greedy_todo],
                                               [tasks[i] for i in sampled_todo], sampling, runtime))
        seconds = time.perf_counter() - started
    fresh = (greedy or []) + (samples or [])
    cached.store(greedy_todo, greedy, sampled_todo, samples, sampling.n)
    items = []
    for index, task in enumerate(tasks):
        items.append(ItemEpisodes(task, cached.greedy[index] if sampling.greedy else None,
                                  cached.sampled[index] if sampling.n else []))
    return items, RunStats(seconds, len(fresh), sum(t.policy_tokens for t in fresh), threads,
                           cached_episodes=cached.hits, items_run=len(set(greedy_todo) | set(sampled_todo)))


async def _collect(policy: Policy, greedy_tasks: list[Task], sampled_tasks: list[Task], sampling: EvalSampling,
                   runtime: EvalRuntime) -> tuple[list[Trajectory] | None, list[Trajectory] | None]:
    from posttrain.envs import rollout_many
    from posttrain.rollout import AsyncBatcher

    options = {"max_concurrency": runtime.max_concurrency or runtime.batch_size,
               "infra_retries": runtime.infra_retries}
    if policy.renderer is not None:
        options["renderer"] = policy.renderer
    greedy = samples = None
    async with AsyncBatcher(policy.engine, max_batch_size=runtime.batch_size) as batcher:
        if sampling.greedy and greedy_tasks:
            greedy = await rollout_many(batcher, greedy_tasks, policy.tokenizer,
                                        SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=0.0),
                                        **options)
        if sampling.n and sampled_tasks:
            sampled = SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                     top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed)
            samples = await rollout_many(batcher, sampled_tasks, policy.tokenizer, sampled, n=sampling.n, **options)
    return greedy, samples


class SuiteEvaluator:
    """``evaluate(model, version) -> {suite name: SuiteScore}``: every suite's items through `run_items` on an
    engine of its own (`make_engine()`, built at the first call; a training loop's rollout engine may be a
    version behind), loaded with `model`'s weights as `version` each time."""

    def __init__(self, suites: Sequence[Suite], tokenizer: Any, make_engine: Callable[[], Any], *,
                 sampling: EvalSampling | None = None, runtime: EvalRuntime | None = None, device: str = "cpu",
                 renderer: Any = None):
        self.suites, self.tokenizer, self._make_engine = list(suites), tokenizer, make_engine
        self.renderer = renderer
        self.sampling, self.runtime, self.device = sampling or EvalSampling(), runtime or EvalRuntime(), device
        self._engine = None

    def __call__(self, model: Any, version: int) -> dict[str, SuiteScore]:
        tasks = [task for suite in self.suites for task in suite.tasks]
        if not tasks:
            return {}
        from posttrain.rollout import state_for_engine

        if self._engine is None:
            self._engine = self._make_engine()
        self._engine.update_weights(state_for_engine(model), version)
        policy = Policy(self._engine, self.tokenizer, f"<training, version {version}>", self.device, self.renderer)
        items, _ = run_items(policy, tasks, self.sampling, self.runtime)
        return score_suites(self.suites, items)


def score_suites(suites: Sequence[Suite], items: Sequence[ItemEpisodes]) -> dict[str, SuiteScore]:
    """`items` (in suite order, as `run_items` returns them for the suites' tasks) scored per suite."""
    return {suite.name: SuiteScore.of(mine) for suite, mine in by_suite(suites, items)}


@contextlib.contextmanager
def engine_threads(policy: Policy, runtime: EvalRuntime):
    import torch

    before = torch.get_num_threads()
    threads = runtime.num_threads or (max(1, before - 1) if policy.device == "cpu" else before)
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def _scaled(task: Task, scale: float) -> Task:
    return task if scale == 1.0 else dataclasses.replace(task, timeout_s=task.timeout_s * scale)
