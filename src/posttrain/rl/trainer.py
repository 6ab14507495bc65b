"""The RL recipe, top to bottom: recipe -> policy + engine -> self-test -> (rollouts -> rewards ->
advantages -> update -> weights to the engine)* -> checkpoint.

    posttrain rl recipe.yaml [--resume]

Rollouts come from `rl.pipeline` (ahead of training by at most `pipeline.max_staleness` versions), episodes
from `posttrain.envs` (token-exact trajectories verified by each task's own verifier), tasks from a
`posttrain.schedule` sampler. Infrastructure failures are retried by the episode loop and, if they persist,
masked out of the batch and counted — never trained on as a reward of 0.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from posttrain.config import dump_recipe
from posttrain.config.rl import RLRecipe
from posttrain.models import (
    ModelError,
    is_lora,
    latest_checkpoint,
    load_model,
    load_tokenizer,
    load_training_state,
    load_weights_from_checkpoint,
    merged_copy,
    reference_mode,
    restore_rng,
    save_checkpoint,
    save_model_dir,
)
from posttrain.rl.advantages import compute_advantages, normalize_per_domain
from posttrain.rl.pipeline import RolloutBatch, RolloutPipeline
from posttrain.rl.returns import episode_return
from posttrain.rl.selftest import engine_trainer_self_test
from posttrain.rl.step import rl_update
from posttrain.schedule import StaticMixture, TaskSampler
from posttrain.tasks import get_domain, sample_tasks
from posttrain.tracking import Tracker, say
from posttrain.train.forward import selected_logits, target_logprobs
from posttrain.train.optim import build_optimizer, build_scheduler
from posttrain.train.step import Runtime, prepare_model, setup_runtime
from posttrain.types import FailureClass, SamplingParams, Task, Trajectory

EPISODES_FILE = "episodes.jsonl"
FAILURES_FILE = "failures.jsonl"


@dataclass
class RLResult:
    output_dir: Path
    final_dir: Path
    steps: int
    seconds: float
    heldout: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class _Cursor:
    step: int = 0  # optimizer steps taken == the policy version the trainer holds
    train_seconds: float = 0.0


def run_rl(
    recipe: RLRecipe,
    *,
    resume: bool = False,
    sampler: TaskSampler | None = None,
    on_step: Callable[[int, dict[str, float]], bool | None] | None = None,
) -> RLResult:
    output_dir = Path(recipe.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "recipe.yaml").write_text(dump_recipe(recipe))
    runtime = setup_runtime(recipe.runtime)
    if recipe.model.path is None:
        raise ModelError("rl: model.path is required (RL starts from a trained model: run `posttrain sft` first)")

    # Policy, engine (its own copy of the weights), reference (only when the KL term is on).
    tokenizer = load_tokenizer(recipe.model)
    model = prepare_model(load_model(recipe.model, tokenizer, runtime.device), recipe.model, recipe.runtime)
    engine = _make_engine(model, tokenizer, runtime, recipe)
    reference = _make_reference(model, recipe, runtime) if recipe.algorithm.kl_coef > 0 else None
    optimizer = build_optimizer(model, recipe.optim)
    scheduler = build_scheduler(optimizer, recipe.optim, recipe.train.max_steps * recipe.train.updates_per_batch)
    sampler = sampler or StaticMixture(recipe.domains, seed=recipe.runtime.seed)
    heldout = heldout_tasks(recipe)

    cursor, pending = _Cursor(), []
    checkpoint = latest_checkpoint(output_dir) if resume else None
    if checkpoint is not None:
        state = load_training_state(checkpoint)
        load_weights_from_checkpoint(model, checkpoint)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        cursor = _Cursor(**state["cursor"])
        pending = [RolloutBatch.from_dict(b) for b in state["pending"]]
        restore_rng(state["rng"])
        say(f"[rl] resumed from {checkpoint} at step {cursor.step}")
    engine.update_weights(engine_state(model), cursor.step)

    tracker = Tracker(output_dir, recipe.tracking, recipe=recipe.model_dump(mode="json"), stage="rl")
    if recipe.pipeline.self_test:
        probe = [t for t in sampler_preview(recipe)][:8]
        gap = engine_trainer_self_test(engine, model, tokenizer, probe, runtime,
                                       temperature=recipe.rollout.sampling.temperature,
                                       max_new_tokens=recipe.rollout.sampling.max_new_tokens,
                                       tolerance=recipe.pipeline.self_test_tolerance, seed=recipe.runtime.seed)
        tracker.log({f"selftest/{k}": v for k, v in gap.items()}, step=cursor.step)
        say(f"[rl] self-test passed: engine vs trainer log-prob gap max {gap['gap_abs_max']:.2e}")

    produce = _Producer(engine, sampler, tokenizer, recipe)
    pipeline = RolloutPipeline(
        produce, engine.update_weights, max_staleness=recipe.pipeline.max_staleness,
        overlap=recipe.pipeline.overlap,
        start_index=cursor.step, start_version=cursor.step, engine_version=cursor.step, pending=pending,
        thread_setup=_thread_budget(recipe.rollout.engine_threads),
    )
    history: list[dict[str, float]] = []
    episodes_log = open(output_dir / EPISODES_FILE, "a", encoding="utf-8")
    evaluator = _HeldoutEvaluator(model, tokenizer, runtime, recipe, heldout)
    try:
        tracker.start_progress(recipe.train.max_steps, done=cursor.step)
        while cursor.step < recipe.train.max_steps:
            if recipe.train.max_minutes is not None and cursor.train_seconds >= recipe.train.max_minutes * 60:
                say(f"[rl] time budget of {recipe.train.max_minutes} min reached at step {cursor.step}")
                break
            started = time.perf_counter()
            batch = pipeline.next_batch()
            metrics = _train_on(batch, cursor.step, model, optimizer, scheduler, tokenizer, runtime, recipe,
                                reference)
            cursor.step += 1
            # A stale batch is sampled from an older version: keep a copy the optimizer will not touch.
            pipeline.publish_weights(cursor.step, engine_state(model, copy=recipe.pipeline.max_staleness > 0))
            _log_episodes(episodes_log, batch)
            metrics["time/step_s"] = time.perf_counter() - started
            cursor.train_seconds += metrics["time/step_s"]
            metrics.update(sampler.report())
            if recipe.train.eval_every and cursor.step % recipe.train.eval_every == 0:
                metrics.update({f"heldout/{k}": v for k, v in evaluator(cursor.step).items()})
            tracker.log(metrics, step=cursor.step)
            tracker.advance(cursor.step, f"reward {metrics.get('reward/mean', 0):.3f}")
            history.append(metrics)
            if recipe.train.save_every and cursor.step % recipe.train.save_every == 0:
                _save(output_dir, recipe, model, tokenizer, optimizer, scheduler, sampler, pipeline, cursor)
            if on_step is not None and on_step(cursor.step, metrics):
                break
        _save(output_dir, recipe, model, tokenizer, optimizer, scheduler, sampler, pipeline, cursor)
        final_dir = save_model_dir(output_dir / "final", model, tokenizer, merge_lora=True)
        final = evaluator(cursor.step) if heldout else {}
        if final:
            tracker.log({f"heldout/{k}": v for k, v in final.items()}, step=cursor.step)
    finally:
        pipeline.close()
        episodes_log.close()
        tracker.close()
    return RLResult(output_dir, final_dir, cursor.step, cursor.train_seconds, final, history)


# ---- the batch -> update step --------------------------------------------------------------------------


def _train_on(batch: RolloutBatch, step: int, model, optimizer, scheduler, tokenizer, runtime: Runtime,
              recipe: RLRecipe, reference) -> dict[str, float]:
    usable, counts = select_trainable(batch.trajectories, step, recipe)
    returns, components = [], defaultdict(list)
    for trajectory in usable:
        total, parts = episode_return(trajectory, recipe.returns, recipe.rollout.sampling.max_new_tokens)
        returns.append(total)
        for name, value in parts.items():
            components[name].append(value)
    if recipe.algorithm.normalize_per_domain:
        returns = normalize_per_domain(returns, [t.domain for t in usable])
    advantages = compute_advantages(returns, [t.group_id for t in usable], recipe.algorithm.advantage,
                                    scale=recipe.algorithm.scale_advantages).tolist()
    trained = [(t, a) for t, a in zip(usable, advantages)
               if not (recipe.returns.overlong == "mask" and t.truncated)]
    counts["overlong_masked"] = len(usable) - len(trained)
    started = time.perf_counter()
    stats = rl_update(
        model, optimizer, scheduler, [t for t, _ in trained], [a for _, a in trained],
        config=recipe.algorithm, runtime=runtime, pad_id=tokenizer.pad_token_id,
        temperature=_train_temperature(recipe), micro_batch_size=recipe.train.micro_batch_size,
        max_grad_norm=recipe.optim.max_grad_norm, normalizer=recipe.rollout.sampling.max_new_tokens,
        updates_per_batch=recipe.train.updates_per_batch, reference=reference,
    ) if trained else {}
    metrics = {f"train/{k}": v for k, v in stats.items()}
    metrics["time/train_s"] = time.perf_counter() - started
    metrics.update({f"time/{k}": v for k, v in batch.timings.items()})
    metrics.update(batch_metrics(batch.trajectories))
    metrics.update({f"return/{k}": sum(v) / len(v) for k, v in components.items() if v})
    metrics.update({f"rollout/{k}": float(v) for k, v in counts.items()})
    metrics["policy/version"] = float(step)
    metrics["policy/staleness"] = float(step - batch.policy_version)
    metrics["train/lr"] = scheduler.get_last_lr()[0]
    return metrics


def select_trainable(trajectories: Sequence[Trajectory], step: int, recipe: RLRecipe
                     ) -> tuple[list[Trajectory], dict[str, int]]:
    """Drop what must not be trained on: infrastructure failures (masked, never a 0 reward) and, by
    recipe, trajectories older than `max_staleness` versions. Returns the rest and the counts."""
    counts = {"episodes": len(trajectories), "infra_masked": 0, "stale_dropped": 0, "stale_kept": 0}
    usable = []
    for trajectory in trajectories:
        if trajectory.reward.is_infrastructure_failure:
            counts["infra_masked"] += 1
            continue
        if trajectory.policy_tokens == 0:
            continue
        if step - trajectory.min_policy_version > recipe.pipeline.max_staleness:
            if recipe.pipeline.stale == "drop":
                counts["stale_dropped"] += 1
                continue
            counts["stale_kept"] += 1  # the behaviour ratio (clipped) reweights it
        usable.append(trajectory)
    return usable, counts


def batch_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    by_domain: dict[str, list[Trajectory]] = defaultdict(list)
    for trajectory in trajectories:
        if not trajectory.reward.is_infrastructure_failure:
            by_domain[trajectory.domain].append(trajectory)
    scored = [t for group in by_domain.values() for t in group]
    metrics: dict[str, float] = {}
    if scored:
        metrics["reward/mean"] = sum(t.reward.score for t in scored) / len(scored)
        metrics["reward/pass_rate"] = sum(t.reward.passed for t in scored) / len(scored)
        metrics["rollout/policy_tokens"] = sum(t.policy_tokens for t in scored) / len(scored)
        metrics["rollout/truncated"] = sum(t.truncated for t in scored) / len(scored)
        metrics["rollout/steps"] = sum(t.steps for t in scored) / len(scored)
        calls = sum(t.tool_calls for t in scored)
        if calls:
            metrics["rollout/tool_call_success"] = sum(t.tool_calls_ok for t in scored) / calls
    for domain, group in by_domain.items():
        metrics[f"reward/{domain}"] = sum(t.reward.score for t in group) / len(group)
        metrics[f"pass_rate/{domain}"] = sum(t.reward.passed for t in group) / len(group)
    failures: dict[str, int] = defaultdict(int)
    for trajectory in trajectories:
        if trajectory.reward.failure is not FailureClass.NONE:
            failures[trajectory.reward.failure.value] += 1
    metrics.update({f"failures/{k}": float(v) for k, v in failures.items()})
    return metrics


# ---- the producer (runs on the rollout side) --------------------------------------------------------------


class _Producer:
    """Produces the batch for step `index` with the engine at `version` (see `rl.pipeline`)."""

    def __init__(self, engine, sampler: TaskSampler, tokenizer, recipe: RLRecipe):
        self.engine, self.sampler, self.tokenizer, self.recipe = engine, sampler, tokenizer, recipe

    def __call__(self, index: int, version: int) -> RolloutBatch:
        rollout = self.recipe.rollout
        started = time.perf_counter()
        tasks = self.sampler.next_batch(rollout.prompts_per_step)
        sampling = SamplingParams(
            max_new_tokens=rollout.sampling.max_new_tokens, temperature=rollout.sampling.temperature,
            top_p=rollout.sampling.top_p, top_k=rollout.sampling.top_k,
            seed=batch_seed(self.recipe.runtime.seed, index),
        )
        trajectories = asyncio.run(self._collect(tasks, sampling))
        self.sampler.observe(trajectories, index)
        return RolloutBatch(index, version, trajectories, timings={"rollout_s": time.perf_counter() - started})

    async def _collect(self, tasks: list[Task], sampling: SamplingParams) -> list[Trajectory]:
        from posttrain.envs import rollout_many
        from posttrain.rollout import AsyncBatcher

        rollout = self.recipe.rollout
        async with AsyncBatcher(self.engine) as batcher:
            return await rollout_many(
                batcher, tasks, self.tokenizer, sampling, n=rollout.sampling.group_size,
                max_concurrency=rollout.max_concurrent_episodes, infra_retries=rollout.infra_retries,
            )


def batch_seed(seed: int, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"rl:{seed}:{index}".encode()).digest()[:4], "big")


# ---- engine, reference, evaluation -----------------------------------------------------------------------


def engine_state(model: torch.nn.Module, copy: bool = False) -> dict[str, torch.Tensor]:
    """The weights an engine serves: the merged model for LoRA; detached (cloned when the trainer will keep
    updating them while the engine still needs this version)."""
    from posttrain.rollout import state_for_engine

    state = state_for_engine(model)
    return {k: v.detach().clone() for k, v in state.items()} if copy else state


def _make_engine(model, tokenizer, runtime: Runtime, recipe: RLRecipe):
    if recipe.rollout.engine == "vllm":
        from posttrain.rollout import VLLMEngine

        return VLLMEngine(recipe.model.path, tokenizer=tokenizer)
    from posttrain.rollout import HFEngine

    engine_model = merged_copy(model) if is_lora(model) else copy.deepcopy(model)
    for parameter in engine_model.parameters():
        parameter.requires_grad_(False)
    return HFEngine(engine_model, tokenizer, autocast=runtime.autocast_dtype,
                    max_batch_size=recipe.rollout.engine_batch_size)


def _make_reference(model, recipe: RLRecipe, runtime: Runtime):
    """log-probs of the scored tokens under the reference policy: the base with the adapter off (LoRA), or a
    frozen copy of the starting weights."""
    temperature = _train_temperature(recipe)
    if is_lora(model):
        def lora_reference(input_ids, attention_mask, score_mask):
            with reference_mode(model):
                logits = selected_logits(model, input_ids, score_mask, attention_mask=attention_mask)
            targets = input_ids[:, 1:][score_mask]
            return target_logprobs(logits, targets, temperature)

        return lora_reference
    frozen = copy.deepcopy(model).eval()
    for parameter in frozen.parameters():
        parameter.requires_grad_(False)

    def copy_reference(input_ids, attention_mask, score_mask):
        logits = selected_logits(frozen, input_ids, score_mask, attention_mask=attention_mask)
        return target_logprobs(logits, input_ids[:, 1:][score_mask], temperature)

    return copy_reference


def _train_temperature(recipe: RLRecipe) -> float:
    temperature = recipe.rollout.sampling.temperature
    return temperature if temperature > 0 else 1.0


def heldout_tasks(recipe: RLRecipe) -> list[Task]:
    tasks = []
    for index, spec in enumerate(recipe.domains):
        if spec.heldout:
            domain = get_domain(spec.name, **spec.args)
            tasks += sample_tasks(domain, spec.heldout, level=spec.levels, split="heldout",
                                  seed=recipe.runtime.seed + 1000 + index)
    return tasks


def sampler_preview(recipe: RLRecipe) -> list[Task]:
    """A few fixed train tasks for the self-test (drawn apart from the run's own sampler)."""
    tasks = []
    for spec in recipe.domains:
        tasks += sample_tasks(get_domain(spec.name, **spec.args), 2, level=spec.levels, split="train", seed=7)
    return tasks


class _HeldoutEvaluator:
    """Greedy pass rate per domain on the held-out tasks, on an engine of its own (the rollout engine may be
    a version behind)."""

    def __init__(self, model, tokenizer, runtime: Runtime, recipe: RLRecipe, tasks: list[Task]):
        self.model, self.tokenizer, self.runtime, self.recipe, self.tasks = model, tokenizer, runtime, recipe, tasks
        self._engine = None

    def __call__(self, version: int) -> dict[str, float]:
        if not self.tasks:
            return {}
        from posttrain.envs import run_episodes

        if self._engine is None:
            self._engine = _make_engine(self.model, self.tokenizer, self.runtime, self.recipe)
        self._engine.update_weights(engine_state(self.model), version)
        sampling = SamplingParams(max_new_tokens=self.recipe.rollout.sampling.max_new_tokens, temperature=0.0)
        trajectories = run_episodes(self._engine, self.tasks, self.tokenizer, sampling)
        passed: dict[str, list[bool]] = defaultdict(list)
        for trajectory in trajectories:
            passed[trajectory.domain].append(trajectory.reward.passed)
        result = {domain: sum(v) / len(v) for domain, v in sorted(passed.items())}
        result["mean"] = sum(result.values()) / len(result)
        return result


# ---- checkpoints and logs -------------------------------------------------------------------------------


def _save(output_dir, recipe: RLRecipe, model, tokenizer, optimizer, scheduler, sampler: TaskSampler,
          pipeline: RolloutPipeline, cursor: _Cursor) -> None:
    # Taken between two batches, so the sampler's state and the pending batches agree.
    pending, sampler_state = pipeline.checkpoint_state(lambda: copy.deepcopy(sampler.state_dict()))
    save_checkpoint(output_dir, cursor.step, model, tokenizer, {
        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "cursor": vars(cursor).copy(),
        "sampler": sampler_state, "pending": [batch.to_dict() for batch in pending],
    }, keep=recipe.train.keep_checkpoints)


def _log_episodes(handle, batch: RolloutBatch) -> None:
    for trajectory in batch.trajectories:
        handle.write(json.dumps(episode_record(trajectory, batch.index)) + "\n")
    handle.flush()


def episode_record(trajectory: Trajectory, step: int) -> dict[str, Any]:
    """What the data flywheel keeps of an episode: the transcript, the verdict, and where it came from."""
    return {
        "step": step,
        "task_id": trajectory.task_id,
        "domain": trajectory.domain,
        "difficulty": trajectory.difficulty,
        "group_id": trajectory.group_id,
        "passed": trajectory.reward.passed,
        "score": trajectory.reward.score,
        "failure": trajectory.reward.failure.value,
        "details": trajectory.reward.details,
        "messages": trajectory.messages,
        "policy_version": trajectory.min_policy_version,
    }


def _thread_budget(threads: int | None) -> Callable[[], None] | None:
    if not threads:
        return None

    def setup() -> None:
        torch.set_num_threads(threads)

    return setup
