"""The RL recipe, top to bottom: recipe -> policy + engine -> self-test -> (rollouts -> rewards ->
advantages -> update -> weights to the engine -> guard)* -> checkpoint.

    posttrain rl recipe.yaml [--resume]

Rollouts come from `rl.pipeline` (ahead of training by at most `pipeline.max_staleness` versions) through
`rl.rollouts` (dynamic sampling), episodes from `posttrain.envs` (token-exact trajectories verified by each
task's own verifier), tasks from a `posttrain.schedule` sampler (by default the `Scheduler` the recipe's
`schedule:` section configures). Infrastructure failures are retried by the episode loop and, if they persist,
masked out of the batch and counted — never trained on as a reward of 0.

The guard (`rl.guarding`) evaluates regression suites every N steps; a regressed suite boosts its domain's
share (from a batch index fixed in advance, so threaded and inline runs agree) and/or adds a replay SFT loss.
A collapse alarm can, by recipe, roll the run back to the last good checkpoint with a lower learning rate.
Every guard event is printed, logged as ``guard/event/<kind>`` and kept in ``schedule_events.jsonl``.

Where the policy trains and where rollouts run is an `RLBackend`: `run_rl` uses `local_backend` (this process:
the model, an HF engine beside it, rollouts on a producer thread); `posttrain.distributed` passes its own to
`run_rl_on` (engine actors, an FSDP trainer group), and the loop below is the same.
"""

from __future__ import annotations

import copy
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch

from posttrain.config import ConfigError, dump_recipe
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
from posttrain.rl.guarding import (
    RunGuard,
    SuiteEvaluator,
    regression_suites,
    replay_sft_backward,
    set_lr_scale,
    suite_metrics,
)
from posttrain.rl.pipeline import RolloutBatch, RolloutPipeline
from posttrain.rl.returns import episode_return
from posttrain.rl.rollouts import BatchProducer, RolloutFn, engine_rollout, sampling_params
from posttrain.rl.selftest import engine_trainer_self_test
from posttrain.rl.step import DataShard, rl_update
from posttrain.schedule import ALARM_KINDS, DROPPED_KEY, Scheduler, TaskSampler, is_dropped
from posttrain.tasks import get_domain, sample_tasks
from posttrain.tracking import Tracker, say
from posttrain.train.forward import selected_logits, target_logprobs
from posttrain.train.optim import build_optimizer, build_scheduler
from posttrain.train.step import Runtime, optimizer_step, prepare_model, setup_runtime
from posttrain.types import FailureClass, Task, Trajectory

EPISODES_FILE = "episodes.jsonl"
FAILURES_FILE = "failures.jsonl"
EVENTS_FILE = "schedule_events.jsonl"
SUMMARY_FILE = "schedule_summary.json"


@dataclass
class RLResult:
    output_dir: Path
    final_dir: Path
    steps: int
    seconds: float
    heldout: dict[str, float] = field(default_factory=dict)  # per domain, and "mean"
    history: list[dict[str, float]] = field(default_factory=list)
    regression: dict[str, float] = field(default_factory=dict)  # general regression suites
    curriculum: dict[str, int] = field(default_factory=dict)  # level per domain at the end
    curriculum_peak: dict[str, int] = field(default_factory=dict)  # highest level reached per domain
    mix_sampled: dict[str, float] = field(default_factory=dict)  # share of groups sampled, whole run
    mix_trained: dict[str, float] = field(default_factory=dict)  # share of groups that reached the trainer
    events: list[dict[str, Any]] = field(default_factory=list)  # guard events, alarms, rollbacks


@dataclass
class _Cursor:
    step: int = 0  # optimizer steps taken == the policy version the trainer holds
    train_seconds: float = 0.0


class PolicyTrainer(Protocol):
    """Where the policy's weights are trained: `LocalPolicy` here, an FSDP trainer group in `posttrain.distributed`."""

    def update(self, trajectories: list[Trajectory], advantages: list[float], replay: list | None
               ) -> dict[str, float]:
        """One batch's optimizer step(s); metrics named as the run logs them (``train/*``, ``guard/replay_*``)."""
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


@dataclass
class _Run:
    """What the loop works on; a rollback swaps the pipeline."""

    recipe: RLRecipe
    output_dir: Path
    tokenizer: Any
    backend: RLBackend
    sampler: TaskSampler
    guard: RunGuard
    runtime: Runtime
    pipeline: RolloutPipeline | None = None

    @property
    def policy(self) -> PolicyTrainer:
        return self.backend.policy

    @property
    def engine(self) -> Any:
        return self.backend.engine


def run_rl(
    recipe: RLRecipe,
    *,
    resume: bool = False,
    sampler: TaskSampler | None = None,
    on_step: Callable[[int, dict[str, float]], bool | None] | None = None,
) -> RLResult:
    if recipe.cluster.backend != "local":
        raise ConfigError(f"rl: cluster.backend is '{recipe.cluster.backend}': run it with `posttrain rl` or "
                          "posttrain.distributed.run_rl (this function runs in one process)")
    return run_rl_on(recipe, local_backend, resume=resume, sampler=sampler, on_step=on_step)


def run_rl_on(
    recipe: RLRecipe,
    make_backend: BackendFactory,
    *,
    resume: bool = False,
    sampler: TaskSampler | None = None,
    on_step: Callable[[int, dict[str, float]], bool | None] | None = None,
) -> RLResult:
    """`run_rl` on the given backend (`local_backend`, or one of `posttrain.distributed`)."""
    output_dir = Path(recipe.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "recipe.yaml").write_text(dump_recipe(recipe))
    runtime = setup_runtime(recipe.runtime)
    if recipe.model.path is None:
        raise ModelError("rl: model.path is required (RL starts from a trained model: run `posttrain sft` first)")

    # Policy, engine(s) with their own copy of the weights, reference (only when the KL term is on).
    tokenizer = load_tokenizer(recipe.model)
    model = prepare_model(load_model(recipe.model, tokenizer, runtime.device), recipe.model, recipe.runtime)
    backend = make_backend(recipe, runtime, tokenizer, model)
    try:
        return _train(recipe, backend, runtime, tokenizer, output_dir, resume, sampler, on_step)
    finally:
        backend.policy.close()
        if backend.close is not None:
            backend.close()


def _train(recipe: RLRecipe, backend: RLBackend, runtime: Runtime, tokenizer, output_dir: Path, resume: bool,
           sampler: TaskSampler | None, on_step) -> RLResult:
    sampler = sampler or Scheduler(recipe.domains, recipe.schedule, seed=recipe.runtime.seed)
    suites = regression_suites(recipe)
    run = _Run(recipe, output_dir, tokenizer, backend, sampler, RunGuard(recipe, suites), runtime)
    policy, engine = run.policy, run.engine

    cursor, pending = _Cursor(), []
    checkpoint = latest_checkpoint(output_dir) if resume else None
    if checkpoint is not None:
        cursor, pending = _restore(run, checkpoint)
        say(f"[rl] resumed from {checkpoint} at step {cursor.step}")
    engine.update_weights(policy.weights(), cursor.step)

    tracker = Tracker(output_dir, recipe.tracking, recipe=recipe.model_dump(mode="json"), stage="rl")
    if recipe.pipeline.self_test:
        probe = [t for t in sampler_preview(recipe)][:8]
        gap = engine_trainer_self_test(engine, policy.full_model(), tokenizer, probe, runtime,
                                       temperature=recipe.rollout.sampling.temperature,
                                       max_new_tokens=recipe.rollout.sampling.max_new_tokens,
                                       tolerance=recipe.pipeline.self_test_tolerance, seed=recipe.runtime.seed)
        tracker.log({f"selftest/{k}": v for k, v in gap.items()}, step=cursor.step)
        say(f"[rl] self-test passed: engine vs trainer log-prob gap max {gap['gap_abs_max']:.2e}")

    model = policy.full_model()  # the evaluator reads it; `full_model()` brings it up to date before each use
    evaluator = SuiteEvaluator(model, tokenizer, suites, recipe.rollout.sampling.max_new_tokens,
                               lambda: _make_engine(model, tokenizer, runtime, recipe))
    history: list[dict[str, float]] = []
    episodes_log = open(output_dir / EPISODES_FILE, "a", encoding="utf-8")
    events_log = open(output_dir / EVENTS_FILE, "a", encoding="utf-8")
    if checkpoint is None and run.guard.wants_baseline():
        baseline, _ = _evaluate(run, evaluator, 0, events_log)
        tracker.log(baseline, step=0)
    run.pipeline = _start_pipeline(run, cursor, pending)
    try:
        tracker.start_progress(recipe.train.max_steps, done=cursor.step)
        while cursor.step < recipe.train.max_steps:
            if recipe.train.max_minutes is not None and cursor.train_seconds >= recipe.train.max_minutes * 60:
                say(f"[rl] time budget of {recipe.train.max_minutes} min reached at step {cursor.step}")
                break
            started = time.perf_counter()
            batch = run.pipeline.next_batch()
            replay = run.guard.replay_batch(cursor.step)
            metrics = _train_on(batch, cursor.step, policy, recipe, replay)
            cursor.step += 1
            # A stale batch is sampled from an older version: keep a copy the optimizer will not touch.
            run.pipeline.publish_weights(cursor.step, policy.weights(copy=recipe.pipeline.max_staleness > 0))
            _log_episodes(episodes_log, batch)
            metrics["time/step_s"] = time.perf_counter() - started
            cursor.train_seconds += metrics["time/step_s"]
            metrics.update(batch_schedule_metrics(batch))
            events: list[dict[str, Any]] = []
            if run.guard.evaluates_at(cursor.step):
                policy.full_model()
                eval_metrics, events = _evaluate(run, evaluator, cursor.step, events_log)
                metrics.update(eval_metrics)
            events += _report_events(run.guard.after_step(cursor.step, metrics), events_log)
            alarms = [event for event in events if event["kind"] in ALARM_KINDS]
            metrics.update(run.guard.metrics())
            metrics.update({f"guard/event/{event['kind']}": 1.0 for event in events})
            tracker.log(metrics, step=cursor.step)
            tracker.advance(cursor.step, f"reward {metrics.get('reward/mean', 0):.3f}")
            history.append(metrics)
            step = cursor.step
            if run.guard.should_roll_back(alarms):
                cursor = _roll_back(run, cursor, events_log)
            elif recipe.train.save_every and step % recipe.train.save_every == 0:
                _save(run, cursor)
                run.guard.mark_saved(step, alarms)
            if on_step is not None and on_step(step, metrics):
                break
        _save(run, cursor)
        final_dir = save_model_dir(output_dir / "final", policy.full_model(), tokenizer, merge_lora=True)
        final = evaluator(cursor.step) if suites else {}
        if final:
            tracker.log(suite_metrics(recipe, final), step=cursor.step)
    finally:
        run.pipeline.close()
        episodes_log.close()
        events_log.close()
        tracker.close()
    result = _result(run, cursor, final_dir, final, history)
    (output_dir / SUMMARY_FILE).write_text(json.dumps(_summary(result), indent=2) + "\n")
    return result


def local_backend(recipe: RLRecipe, runtime: Runtime, tokenizer, model: torch.nn.Module) -> RLBackend:
    """The policy trained in this process, rollouts from an HF engine beside it on the producer thread."""
    engine = _make_engine(model, tokenizer, runtime, recipe)
    return RLBackend(LocalPolicy(model, tokenizer, runtime, recipe), engine, engine_rollout(engine, tokenizer, recipe),
                     thread_setup=_thread_budget(recipe.rollout.engine_threads))


class LocalPolicy:
    """The policy, its optimizer and schedule (and the reference, when the KL term is on) in this process.

    A data-parallel rank (`posttrain.distributed`) runs the same with its sharded model and a `DataShard`."""

    def __init__(self, model: torch.nn.Module, tokenizer, runtime: Runtime, recipe: RLRecipe, *,
                 shard: DataShard | None = None, replay_scale: float = 1.0, reference=None):
        self.model, self.tokenizer, self.runtime, self.recipe = model, tokenizer, runtime, recipe
        self.shard, self.replay_scale = shard, replay_scale
        if reference is None and recipe.algorithm.kl_coef > 0:
            reference = make_reference(model, recipe, runtime)
        self.reference = reference
        self.optimizer = build_optimizer(model, recipe.optim)
        self.scheduler = build_scheduler(self.optimizer, recipe.optim,
                                         recipe.train.max_steps * recipe.train.updates_per_batch)
        self.base_lrs = list(self.scheduler.base_lrs)

    def update(self, trajectories: list[Trajectory], advantages: list[float], replay: list | None
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
        stats = rl_update(
            model, self.optimizer, self.scheduler, trajectories, advantages,
            config=recipe.algorithm, runtime=self.runtime, pad_id=self.tokenizer.pad_token_id,
            temperature=_train_temperature(recipe), micro_batch_size=recipe.train.micro_batch_size,
            max_grad_norm=recipe.optim.max_grad_norm, normalizer=recipe.rollout.sampling.max_new_tokens,
            updates_per_batch=recipe.train.updates_per_batch, reference=self.reference, shard=self.shard,
        ) if trajectories else {}
        if not trajectories and "guard/replay_loss" in metrics:
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
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def set_lr_scale(self, scale: float) -> None:
        set_lr_scale(self.optimizer, self.scheduler, self.base_lrs, scale)

    def close(self) -> None:
        pass


def _start_pipeline(run: _Run, cursor: _Cursor, pending: list[RolloutBatch]) -> RolloutPipeline:
    recipe = run.recipe
    produce = BatchProducer(
        run.backend.rollout, run.sampler,
        prompts_per_step=recipe.rollout.prompts_per_step, sampling=sampling_params(recipe),
        seed=recipe.runtime.seed, dynamic=recipe.schedule.dynamic_sampling, attempt=run.guard.rollbacks,
    )
    return RolloutPipeline(
        produce, run.engine.update_weights, max_staleness=recipe.pipeline.max_staleness,
        overlap=recipe.pipeline.overlap,
        start_index=cursor.step, start_version=cursor.step, engine_version=cursor.step, pending=pending,
        thread_setup=run.backend.thread_setup,
    )


def _evaluate(run: _Run, evaluator: SuiteEvaluator, step: int, events_log
              ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Evaluate the suites, feed the guard, and hand its boosts to the sampler from a fixed batch index on."""
    results = evaluator(step)
    before = run.guard.forgetting.boosted_domains()
    events = _report_events(run.guard.after_eval(step, results), events_log)
    boosted = run.guard.forgetting.boosted_domains()
    if boosted != before and hasattr(run.sampler, "boost_domains"):
        # The producer may already be drawing batches up to step + max_staleness: the boost starts after them.
        run.sampler.boost_domains(boosted, step + run.recipe.pipeline.max_staleness + 1)
    metrics = suite_metrics(run.recipe, results)
    metrics.update({f"guard/event/{event['kind']}": 1.0 for event in events})
    return metrics, events


def _roll_back(run: _Run, cursor: _Cursor, events_log) -> _Cursor:
    """Back to the last good checkpoint (if one is left) with the learning rate lowered; says so."""
    target, target_step = run.guard.rollback_target(run.output_dir)
    _report_events([run.guard.begin_rollback(cursor.step, target_step)], events_log)
    if target is None:
        run.policy.set_lr_scale(run.guard.lr_scale)
        return cursor
    run.pipeline.close()
    # The checkpoint's pending batches are dropped: trained again from the same weights they would repeat the
    # very step that raised the alarm. The sampler goes on from its checkpointed state with fresh seeds.
    restored, _ = _restore(run, target, keep_history=True)
    restored.train_seconds = cursor.train_seconds  # the time budget counts the discarded steps too
    run.engine.update_weights(run.policy.weights(), restored.step)
    run.pipeline = _start_pipeline(run, restored, [])
    return restored


def _restore(run: _Run, checkpoint: Path, *, keep_history: bool = False) -> tuple[_Cursor, list[RolloutBatch]]:
    state = load_training_state(checkpoint)
    run.policy.load_checkpoint(checkpoint, state)
    run.sampler.load_state_dict(state["sampler"])
    if "guard" in state:
        run.guard.load_state_dict(state["guard"], keep_history=keep_history)
    if run.guard.lr_scale != 1.0:
        run.policy.set_lr_scale(run.guard.lr_scale)
    restore_rng(state["rng"])
    return _Cursor(**state["cursor"]), [RolloutBatch.from_dict(b) for b in state["pending"]]


def _report_events(events: list[dict[str, Any]], events_log) -> list[dict[str, Any]]:
    for event in events:
        say(f"[rl] {describe_event(event)}")
        events_log.write(json.dumps(event) + "\n")
    events_log.flush()
    return events


def describe_event(event: dict[str, Any]) -> str:
    kind, step = event["kind"], event["step"]
    if kind == "regression":
        return (f"step {step}: guard: suite '{event['suite']}' fell to {event['value']:.3f} (best {event['best']:.3f} "
                f"at step {event['best_step']}); action: {', '.join(event['actions'])}")
    if kind == "recovered":
        return f"step {step}: guard: suite '{event['suite']}' recovered to {event['value']:.3f}"
    if kind == "rollback":
        return (f"step {step}: rolled back to the checkpoint of step {event['to_step']}, learning rate now "
                f"x{event['lr_scale']:g} (rollback {event['rollbacks']})")
    if kind == "lr_decrease":
        return f"step {step}: no good checkpoint to roll back to; learning rate now x{event['lr_scale']:g}"
    return f"step {step}: alarm {kind}: {event['metric']} = {event['value']:.4g} (threshold {event['threshold']:.4g})"


def _result(run: _Run, cursor: _Cursor, final_dir: Path, final: dict[str, float],
            history: list[dict[str, float]]) -> RLResult:
    last = history[-1] if history else {}
    names = [spec.name for spec in run.recipe.domains]

    def per_domain(prefix: str, cast=float) -> dict[str, Any]:
        return {name: cast(last[f"{prefix}/{name}"]) for name in names if f"{prefix}/{name}" in last}

    metrics = suite_metrics(run.recipe, final)
    return RLResult(
        run.output_dir, final_dir, cursor.step, cursor.train_seconds,
        heldout={k.removeprefix("heldout/"): v for k, v in metrics.items() if k.startswith("heldout/")},
        history=history,
        regression={k.removeprefix("regression/"): v for k, v in metrics.items() if k.startswith("regression/")},
        curriculum=per_domain("curriculum", int), curriculum_peak=per_domain("curriculum/peak", int),
        mix_sampled=per_domain("mix/sampled"), mix_trained=per_domain("mix/trained"),
        events=[dict(e) for e in run.guard.events],
    )


def _summary(result: RLResult) -> dict[str, Any]:
    return {"steps": result.steps, "heldout": result.heldout, "regression": result.regression,
            "curriculum": result.curriculum, "curriculum_peak": result.curriculum_peak,
            "mix_sampled": result.mix_sampled, "mix_trained": result.mix_trained, "events": result.events}


# ---- the batch -> update step --------------------------------------------------------------------------


def _train_on(batch: RolloutBatch, step: int, policy: PolicyTrainer, recipe: RLRecipe,
              replay: list | None = None) -> dict[str, float]:
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
    metrics = policy.update([t for t, _ in trained], [a for _, a in trained], replay)
    metrics["time/train_s"] = time.perf_counter() - started
    metrics.update({f"time/{k}": v for k, v in batch.timings.items()})
    metrics.update(batch_metrics(batch.trajectories))
    metrics.update({f"return/{k}": sum(v) / len(v) for k, v in components.items() if v})
    metrics.update({f"rollout/{k}": float(v) for k, v in counts.items()})
    metrics["policy/version"] = float(step)
    metrics["policy/staleness"] = float(step - batch.policy_version)
    return metrics


def select_trainable(trajectories: Sequence[Trajectory], step: int, recipe: RLRecipe
                     ) -> tuple[list[Trajectory], dict[str, int]]:
    """Drop what must not be trained on: infrastructure failures (masked, never a 0 reward), groups the
    producer dropped (no reward spread), and, by recipe, trajectories older than `max_staleness` versions.
    Returns the rest and the counts."""
    counts = {"episodes": len(trajectories), "infra_masked": 0, "filtered": 0, "stale_dropped": 0, "stale_kept": 0}
    usable = []
    for trajectory in trajectories:
        if trajectory.reward.is_infrastructure_failure:
            counts["infra_masked"] += 1
            continue
        if is_dropped(trajectory):
            counts["filtered"] += 1
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


def batch_schedule_metrics(batch: RolloutBatch) -> dict[str, float]:
    """The producer's snapshot of the sampler (curriculum, mix, counters) and its dynamic-sampling counts."""
    metrics = {f"dynamic/{k}": float(v) for k, v in batch.stats.get("dynamic", {}).items()}
    metrics.update({k: float(v) for k, v in batch.stats.get("schedule", {}).items()})
    return metrics


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


def make_reference(model, recipe: RLRecipe, runtime: Runtime):
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


def sampler_preview(recipe: RLRecipe) -> list[Task]:
    """A few fixed train tasks for the self-test (drawn apart from the run's own sampler)."""
    tasks = []
    for spec in recipe.domains:
        tasks += sample_tasks(get_domain(spec.name, **spec.args), 2, level=spec.levels, split="train", seed=7)
    return tasks


# ---- checkpoints and logs -------------------------------------------------------------------------------


def _save(run: _Run, cursor: _Cursor) -> None:
    # Taken between two batches, so the sampler's state and the pending batches agree.
    pending, sampler_state = run.pipeline.checkpoint_state(lambda: copy.deepcopy(run.sampler.state_dict()))
    save_checkpoint(run.output_dir, cursor.step, run.policy.full_model(), run.tokenizer, {
        **run.policy.state_dict(), "cursor": vars(cursor).copy(), "sampler": sampler_state, "pending": [batch.to_dict() for batch in pending],
        "guard": copy.deepcopy(run.guard.state_dict()),
    }, keep=run.recipe.train.keep_checkpoints)


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
        "dropped": trajectory.metadata.get(DROPPED_KEY),  # why the group did not reach the trainer, if it did not
    }


def _thread_budget(threads: int | None) -> Callable[[], None] | None:
    if not threads:
        return None

    def setup() -> None:
        torch.set_num_threads(threads)

    return setup
