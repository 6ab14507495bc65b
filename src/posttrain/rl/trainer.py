"""The RL recipe, top to bottom: recipe -> tokenizer (`starting_tokenizer`) and policy -> backend (the engine beside
it) -> self-test -> iterations -> checkpoint.

    posttrain rl recipe.yaml [--resume]

One iteration (`_iteration`, the whole of it in one function):

    batch       rollouts for step k from `rl.pipeline` (ahead of training by at most `pipeline.max_staleness`
                versions; dynamic sampling; infrastructure failures retried by the episode loop, then masked out
                and counted, never trained on as a reward of 0)
    returns     each trainable episode's return (`rl.advantages.episode_return`: the verifier's outcome, costs,
                shaping, a learned reward component when the recipe has `reward_model:`)
    advantages  group-relative (`compute_advantages`), or with `algorithm.advantage: gae` per-token GAE from the
                critic's values (`rl.learned.Critic`), which trains beside the policy
    segments    an episode is one sequence, or several when a black-box agent rewrote its history
                (`posttrain.envs.trajectory_segments`): each is trained on with its episode's advantage (return)
    update      the policy's optimizer step(s) (`PolicyTrainer.update` -> `rl.update.rl_update`, its settings one
                `UpdateSettings` built from the recipe), plus the replay SFT loss the guard asks for; sequences
                of zero advantage skipped where that is exact (``train/skipped_zero_adv_*``)
    weights     the new version published to the engine(s)
    guard       every N steps the suites are evaluated through `posttrain.evaluate` (`evaluate(model, version)`:
                the same episodes and pass@1 as `posttrain eval`, infrastructure failures counted, never scored);
                `rl.guarding.RunGuard` turns a regression into a domain boost (from a batch index fixed in
                advance, so threaded and inline runs agree) and/or replay SFT, and a collapse alarm can roll the
                run back to the last good checkpoint with a lower learning rate

Every guard event is printed, logged as ``guard/event/<kind>`` and kept in ``schedule_events.jsonl``; every episode
goes to ``episodes.jsonl`` (the data flywheel). Tasks come from a `posttrain.schedule` sampler (by default the
`Scheduler` the recipe's `schedule:` section configures).

**Images** (`model.vision: true`, or a `model.path` whose config has a `vision_config`; docs/multimodal.md): the
policy is a vision-language model with its processor (`rl.vision.load_vision_policy`; unset `model.path`: the
built-in tiny VLM), the processor's tokenizer goes wherever a tokenizer goes, and the episode loop renders image
prompts through the processor (`rl.vision.ProcessorRenderer`): the engine's prefill and the trainer's forward get
the same image tensors (the trajectory carries them), the self-test runs on the domains' image prompts, and
checkpoints hold the processor. Local backend, group-relative advantages, no LoRA, no learned rewards yet.

Where the policy trains and where rollouts run is an `RLBackend` (`rl.backend`): `run_rl` uses `local_backend`
(this process: the model, an HF engine beside it, rollouts on a producer thread); `posttrain.distributed` passes
its own to `run_rl_on` (engine actors, an FSDP trainer group), and the loop below is the same.
"""

from __future__ import annotations

import copy
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

from posttrain.config import ConfigError, RLRecipe
from posttrain.envs import trajectory_segments
from posttrain.evaluate import SuiteScore
from posttrain.models import (
    CompileMeter,
    compile_shape_key,
    load_model,
    load_tokenizer,
    read_compile_record,
    save_model_dir,
)
from posttrain.rl.advantages import (
    compute_advantages,
    episode_return,
    gae_advantages,
    normalize_per_domain,
    reward_metrics,
    whiten,
    with_rewards,
)
from posttrain.rl.backend import BackendFactory, RLBackend, engine_trainer_self_test, local_backend
from posttrain.rl.learned import Critic, LearnedReward, ProcessRewardModel, make_critic
from posttrain.rl.pipeline import (
    BatchProducer,
    RolloutBatch,
    RolloutPipeline,
    batch_metrics,
    batch_schedule_metrics,
    describe_event,
    episode_record,
    sampling_params,
    select_trainable,
)
from posttrain.rl.guarding import (EVAL_PREFIXES, EvaluateFn, RunGuard, eval_metrics_of, regression_suites,
                                  suite_evaluator)
from posttrain.rl.update import PolicyTrainer
from posttrain.rl.vision import ProcessorRenderer, load_vision_policy, wants_vision
from posttrain.schedule import ALARM_KINDS, Scheduler, TaskSampler
from posttrain.tasks import TaskError, get_domain, sample_tasks
from posttrain.tracking import METRICS_FILE, Tracker, read_metrics, say
from posttrain.train import (
    Runtime,
    find_checkpoint,
    open_run_dir,
    prepare_model,
    resolve_compile,
    restore_training,
    setup_runtime,
    write_checkpoint,
)
from posttrain.types import Task, Trajectory
from posttrain.usercode import import_all

EPISODES_FILE = "episodes.jsonl"
EVENTS_FILE = "schedule_events.jsonl"
SUMMARY_FILE = "schedule_summary.json"
CORPUS_TASKS_PER_DOMAIN = 64  # tasks per domain whose text trains a fresh built-in model's tokenizer


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
    infra_failures: dict[str, int] = field(default_factory=dict)  # per suite at the final evaluation, never scored
    # every evaluation of the suites (baseline, every N steps, final): step, seconds and figures; a resumed run has
    # the evaluations before its checkpoint from metrics.jsonl
    evaluations: list[dict[str, float]] = field(default_factory=list)
    stopped_by: str = ""  # "steps" (train.max_steps), "time_cap" (train.max_minutes: warned) or "on_step"


@dataclass
class _Cursor:
    step: int = 0  # optimizer steps taken == the policy version the trainer holds
    train_seconds: float = 0.0


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
    processor: Any = None  # a vision-language policy's processor (its tokenizer is `tokenizer`)
    renderer: ProcessorRenderer | None = None  # image prompts in the episode loop (with `processor`)
    learned_reward: LearnedReward | None = None  # the recipe's `reward_model:` section
    process_model: ProcessRewardModel | None = None  # the recipe's `process_reward_model:` section
    critic: Critic | None = None  # algorithm.advantage: gae
    evaluations: list[dict[str, float]] = field(default_factory=list)  # RLResult.evaluations

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
                          "posttrain.distributed.launch_rl (this function runs in one process)")
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
    import_all(recipe.imports)  # a recipe built in code (load_recipe imports them too; a second import is a no-op)
    output_dir = open_run_dir(recipe, "rl", resume, logs=(EPISODES_FILE, EVENTS_FILE))
    runtime = setup_runtime(recipe.runtime)
    vision = wants_vision(recipe.model)
    if vision and recipe.runtime.compile == "auto":  # the decoder compile is for text models
        recipe = recipe.model_copy(update={"runtime": recipe.runtime.model_copy(update={"compile": False})})
    # Policy (model.path, or a fresh built-in model: `starting_tokenizer`), engine(s) with their own copy of the
    # weights, reference (only when the KL term is on).
    processor = renderer = meter = None
    if vision:  # a vision-language policy: its processor's tokenizer everywhere
        _require_vision_support(recipe, make_backend)
        model, processor = load_vision_policy(recipe.model, None if recipe.model.path else starting_tokenizer(recipe),
                                              runtime.device)
        tokenizer, renderer = processor.tokenizer, ProcessorRenderer(processor)
    else:
        tokenizer = starting_tokenizer(recipe)
        model = load_model(recipe.model, tokenizer, runtime.device)
        # compile "auto" decided once, here, from the run's length and what this machine measured for the model's
        # shape: the trainer and the engine(s) then read a plain true/false
        shape = compile_shape_key(model.config, runtime.precision, runtime.device.type,
                                  lora=recipe.model.lora.enabled, checkpointing=recipe.runtime.activation_checkpointing)
        recipe = recipe.model_copy(update={"runtime": resolve_compile(
            recipe.runtime, recipe.train.max_steps, runtime.device, read_compile_record(shape))})
        if make_backend is local_backend:  # (other backends compile in other processes: their CPU is not seen here)
            meter = CompileMeter(shape, compiled=recipe.runtime.compile is True)
        model = prepare_model(model, recipe.model, recipe.runtime)
    # The critic copies the starting policy before a backend takes the model (and perhaps shards it).
    critic = make_critic(recipe, model, tokenizer, runtime) if recipe.algorithm.advantage == "gae" else None
    learned = LearnedReward(recipe.reward_model, tokenizer, runtime.device) if recipe.reward_model else None
    backend = make_backend(recipe, runtime, tokenizer, model, **({"renderer": renderer} if renderer else {}))
    try:
        return _train(recipe, backend, runtime, tokenizer, output_dir, resume=resume, sampler=sampler, on_step=on_step,
                      learned_reward=learned, critic=critic, processor=processor, renderer=renderer,
                      compile_meter=meter)
    finally:
        backend.policy.close()
        if backend.close is not None:
            backend.close()


def _train(recipe: RLRecipe, backend: RLBackend, runtime: Runtime, tokenizer, output_dir: Path, *, resume: bool,
           sampler: TaskSampler | None, on_step, learned_reward: LearnedReward | None,
           critic: Critic | None, processor: Any = None, renderer: ProcessorRenderer | None = None,
           compile_meter: CompileMeter | None = None) -> RLResult:
    sampler = sampler or Scheduler(recipe.domains, recipe.schedule, seed=recipe.runtime.seed)
    suites = regression_suites(recipe)
    run = _Run(recipe, output_dir, tokenizer, backend, sampler, RunGuard(recipe, suites), runtime,
               processor=processor, renderer=renderer, learned_reward=learned_reward, critic=critic)
    if recipe.process_reward_model is not None:
        run.process_model = ProcessRewardModel(recipe.process_reward_model, tokenizer, runtime.device)
    policy, engine = run.policy, run.engine

    cursor, pending = _Cursor(), []
    checkpoint = find_checkpoint(output_dir, "rl") if resume else None
    if checkpoint is not None:
        cursor, pending = _restore(run, checkpoint)
    engine.update_weights(policy.weights(), cursor.step)

    tracker = Tracker(output_dir, recipe.tracking, recipe=recipe.model_dump(mode="json"), stage="rl")
    if recipe.pipeline.self_test:
        probe = [t for t in sampler_preview(recipe)][:8]
        gap = engine_trainer_self_test(engine, policy.full_model(), tokenizer, probe, runtime,
                                       temperature=recipe.rollout.sampling.temperature,
                                       max_new_tokens=recipe.rollout.sampling.max_new_tokens,
                                       tolerance=recipe.pipeline.self_test_tolerance, seed=recipe.runtime.seed,
                                       processor=run.processor)
        tracker.log({f"selftest/{k}": v for k, v in gap.items()}, step=cursor.step)
        say(f"[rl] self-test passed: engine vs trainer log-prob gap max {gap['gap_abs_max']:.2e}")

    evaluate = suite_evaluator(recipe, suites, policy.full_model(), tokenizer, runtime, renderer=run.renderer)
    history, run.evaluations = _logged_before(output_dir, cursor.step) if checkpoint is not None else ([], [])
    logs = _Logs(open(output_dir / EPISODES_FILE, "a", encoding="utf-8"),
                 open(output_dir / EVENTS_FILE, "a", encoding="utf-8"))
    if checkpoint is None and run.guard.wants_baseline():
        baseline, _ = _evaluate(run, evaluate, 0, logs.events)
        tracker.log(baseline, step=0)
    run.pipeline = _start_pipeline(run, cursor, pending)
    time_capped = False
    try:
        tracker.start_progress(recipe.train.max_steps, done=cursor.step)
        while cursor.step < recipe.train.max_steps:
            if recipe.train.max_minutes is not None and cursor.train_seconds >= recipe.train.max_minutes * 60:
                say(f"[rl] WARNING: the time cap of {recipe.train.max_minutes} min cut training short at step "
                    f"{cursor.step} of {recipe.train.max_steps}: the result now depends on this machine's speed")
                time_capped = True
                break
            metrics, events = _iteration(run, cursor.step, evaluate, logs)
            if compile_meter is not None:  # the first steps' CPU time: what compiling cost, and a steady step
                compile_meter.observe(metrics["time/step_cpu_s"], metrics["tokens/sampled"] + metrics["tokens/trained"])
            cursor.step += 1
            cursor.train_seconds += metrics["time/step_s"]  # the time budget counts training, not evaluation
            alarms = [event for event in events if event["kind"] in ALARM_KINDS]
            tracker.log(metrics, step=cursor.step)
            tracker.advance(cursor.step, f"reward {metrics.get('reward/mean', 0):.3f}")
            history.append(metrics)
            step = cursor.step
            if run.guard.should_roll_back(alarms):
                cursor = _roll_back(run, cursor, logs.events)
            elif recipe.train.save_every and step % recipe.train.save_every == 0:
                _save(run, cursor)
                run.guard.mark_saved(step, alarms)
            if on_step is not None and on_step(step, metrics):
                break
        _save(run, cursor)
        final_dir = save_model_dir(output_dir / "final", policy.full_model(), run.processor or tokenizer,
                                   merge_lora=recipe.model.lora.merge_on_save)
        if run.critic is not None:
            run.critic.save(output_dir / "critic")
        began = time.perf_counter()
        final = evaluate(policy.full_model(), cursor.step) if suites else {}
        if final:
            final_metrics = eval_metrics_of(recipe, final)
            tracker.log(final_metrics, step=cursor.step)
            run.evaluations.append({"step": cursor.step, "seconds": time.perf_counter() - began, "final": 1.0,
                                    **final_metrics})
    finally:
        if compile_meter is not None:
            compile_meter.close()
        run.pipeline.close()
        logs.episodes.close()
        logs.events.close()
        tracker.close()
    result = _result(run, cursor, final_dir, final, history)
    result.stopped_by = "time_cap" if time_capped else "on_step" if cursor.step < recipe.train.max_steps else "steps"
    (output_dir / SUMMARY_FILE).write_text(json.dumps(_summary(result), indent=2) + "\n")
    return result


def _start_pipeline(run: _Run, cursor: _Cursor, pending: list[RolloutBatch]) -> RolloutPipeline:
    recipe = run.recipe
    produce = BatchProducer(
        with_rewards(run.backend.rollout, run.recipe), run.sampler,
        prompts_per_step=recipe.rollout.prompts_per_step, sampling=sampling_params(recipe),
        seed=recipe.runtime.seed, dynamic=recipe.schedule.dynamic_sampling, attempt=run.guard.rollbacks,
    )
    return RolloutPipeline(
        produce, run.engine.update_weights, max_staleness=recipe.pipeline.max_staleness,
        overlap=recipe.pipeline.overlap and recipe.pipeline.max_staleness > 0,  # synchronous: nothing to overlap
        start_index=cursor.step, start_version=cursor.step, engine_version=cursor.step, pending=pending,
        thread_setup=run.backend.thread_setup,
    )


def _evaluate(run: _Run, evaluate: EvaluateFn, step: int, events_log
              ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Evaluate the suites, feed the guard, and hand its boosts to the sampler from a fixed batch index on."""
    began = time.perf_counter()
    scores = evaluate(run.policy.full_model(), step)
    before = run.guard.forgetting.boosted_domains()
    events = _report_events(run.guard.after_eval(step, scores), events_log)
    boosted = run.guard.forgetting.boosted_domains()
    if boosted != before and hasattr(run.sampler, "boost_domains"):
        # The producer may already be drawing batches up to step + max_staleness: the boost starts after them.
        run.sampler.boost_domains(boosted, step + run.recipe.pipeline.max_staleness + 1)
    figures = eval_metrics_of(run.recipe, scores)
    metrics = {**figures, **{f"guard/event/{event['kind']}": 1.0 for event in events}}
    metrics["time/eval_s"] = time.perf_counter() - began  # wall time, apart from the step's time/step_s
    run.evaluations.append({"step": step, "seconds": metrics["time/eval_s"], **figures})
    return metrics, events


def _roll_back(run: _Run, cursor: _Cursor, events_log) -> _Cursor:
    """Back to the last good checkpoint (if one is left) with the learning rate lowered; says so."""
    target, target_step = run.guard.rollback_target(run.output_dir)
    _report_events([run.guard.begin_rollback(cursor.step, target_step)], events_log)
    if target is None:
        _scale_lr(run)
        return cursor
    run.pipeline.close()
    # The checkpoint's pending batches are dropped: trained again from the same weights they would repeat the
    # very step that raised the alarm. The sampler goes on from its checkpointed state with fresh seeds.
    restored, _ = _restore(run, target, keep_history=True)
    restored.train_seconds = cursor.train_seconds  # the time budget counts the discarded steps too
    run.engine.update_weights(run.policy.weights(), restored.step)
    run.pipeline = _start_pipeline(run, restored, [])
    return restored


def _scale_lr(run: _Run) -> None:
    """The guard's learning-rate scale on the policy and, with PPO, the critic."""
    run.policy.set_lr_scale(run.guard.lr_scale)
    if run.critic is not None:
        run.critic.set_lr_scale(run.guard.lr_scale)


def _logged_before(output_dir: Path, step: int) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """A resumed run's steps and evaluations up to its checkpoint's `step`, from metrics.jsonl (a step the crashed
    process ran past the checkpoint is re-run and logged again; `read_metrics` keeps the last), so a resumed run's
    result -- the demo's compute count, its judging share, the guard's evaluations since the baseline -- covers the
    whole run. An evaluation's record is the one with `time/eval_s` (a step's, or the baseline's at step 0); the
    final evaluation is logged without it and comes after the last checkpoint."""
    records = [{k: v for k, v in record.items() if k != "time"} for record in read_metrics(output_dir / METRICS_FILE)
               if 0 <= record.get("step", 0) <= step]
    steps = [record for record in records if "time/step_s" in record and record["step"] > 0]
    evaluations = [{"step": record["step"], "seconds": record["time/eval_s"],
                    **{k: v for k, v in record.items() if k.startswith(EVAL_PREFIXES)}}
                   for record in records if "time/eval_s" in record]
    return steps, evaluations


def _restore(run: _Run, checkpoint: Path, *, keep_history: bool = False) -> tuple[_Cursor, list[RolloutBatch]]:
    def restore(state: dict[str, Any]) -> None:
        run.policy.load_checkpoint(checkpoint, state)  # weights, optimizer and schedule, wherever the policy trains
        if run.critic is not None:
            run.critic.load_checkpoint(checkpoint, state)
        run.sampler.load_state_dict(state["sampler"])
        if "guard" in state:
            run.guard.load_state_dict(state["guard"], keep_history=keep_history)
        if run.guard.lr_scale != 1.0:
            _scale_lr(run)

    state = restore_training(checkpoint, "rl", restore=restore, announce=not keep_history)
    return _Cursor(**state["cursor"]), [RolloutBatch.from_dict(b) for b in state["pending"]]


def _report_events(events: list[dict[str, Any]], events_log) -> list[dict[str, Any]]:
    for event in events:
        say(f"[rl] {describe_event(event)}")
        events_log.write(json.dumps(event) + "\n")
    events_log.flush()
    return events


def _result(run: _Run, cursor: _Cursor, final_dir: Path, final: dict[str, SuiteScore],
            history: list[dict[str, float]]) -> RLResult:
    last = history[-1] if history else {}
    names = [spec.name for spec in run.recipe.domains]

    def per_domain(prefix: str, cast=float) -> dict[str, Any]:
        return {name: cast(last[f"{prefix}/{name}"]) for name in names if f"{prefix}/{name}" in last}

    metrics = eval_metrics_of(run.recipe, final)
    return RLResult(
        run.output_dir, final_dir, cursor.step, cursor.train_seconds,
        heldout={k.removeprefix("heldout/"): v for k, v in metrics.items() if k.startswith("heldout/")},
        history=history,
        regression={k.removeprefix("regression/"): v for k, v in metrics.items() if k.startswith("regression/")},
        curriculum=per_domain("curriculum", int), curriculum_peak=per_domain("curriculum/peak", int),
        mix_sampled=per_domain("mix/sampled"), mix_trained=per_domain("mix/trained"),
        events=[dict(e) for e in run.guard.events],
        infra_failures={name: score.infra_failures for name, score in final.items()},
        evaluations=[dict(e) for e in run.evaluations],
    )


def _summary(result: RLResult) -> dict[str, Any]:
    return {"steps": result.steps, "heldout": result.heldout, "regression": result.regression,
            "curriculum": result.curriculum, "curriculum_peak": result.curriculum_peak,
            "mix_sampled": result.mix_sampled, "mix_trained": result.mix_trained, "events": result.events,
            "infra_failures": result.infra_failures}


# ---- one iteration: batch -> returns -> advantages -> update -> weights -> guard ---------------------------


@dataclass
class _Logs:
    episodes: IO[str]  # episodes.jsonl
    events: IO[str]  # schedule_events.jsonl


def _iteration(run: _Run, step: int, evaluate: EvaluateFn, logs: _Logs) -> tuple[dict[str, float], list[dict]]:
    """Step `step` -> version `step + 1`: its metrics and the guard's events."""
    recipe, policy = run.recipe, run.policy
    began, began_cpu = time.perf_counter(), time.process_time()
    # batch: what the pipeline sampled for this step, less what must not be trained on
    batch = run.pipeline.next_batch()
    replay = run.guard.replay_batch(step)
    trajectories, counts = select_trainable(batch.trajectories, step, recipe)
    if run.renderer is not None:  # a batch restored from a checkpoint kept its images' reference, not the pixels
        run.renderer.attach(trajectories)
    metrics = run.learned_reward.annotate(trajectories) if run.learned_reward is not None else {}
    if run.process_model is not None:
        metrics.update(run.process_model.annotate(trajectories))
    metrics.update(reward_metrics(trajectories))  # each of the recipe's `rewards:` terms, by name

    # returns
    returns, components = _returns(run, trajectories)
    # `overlong: mask` keeps a truncated episode in its group's baseline but out of the loss.
    kept = [not (recipe.returns.overlong == "mask" and t.truncated) for t in trajectories]
    counts["overlong_masked"] = kept.count(False)

    # advantages -> update (with a critic: its values -> GAE -> the policy's and the critic's updates)
    started = time.perf_counter()
    if run.critic is None:
        advantages = compute_advantages(returns, [t.group_id for t in trajectories], recipe.algorithm.advantage,
                                        scale=recipe.algorithm.scale_advantages).tolist()
        trained = [(s, a) for t, a, keep in zip(trajectories, advantages, kept) if keep for s in trajectory_segments(t)]
        metrics.update(policy.update([t for t, _ in trained], [a for _, a in trained], replay))
    else:
        trained = [(s, r) for t, r, keep in zip(trajectories, returns, kept) if keep for s in trajectory_segments(t)]
        metrics.update(_ppo_update(run, [t for t, _ in trained], [r for _, r in trained], replay))
    metrics["time/train_s"] = time.perf_counter() - started
    counts["sequences"] = len(trained)  # an agent's episode whose calls broke the transcript is several
    # Compute, in tokens through the model: every sampled sequence once (the engine), every trained one through a
    # forward and a backward (what `sft_control` matches) -- less those the update skipped (zero advantage).
    metrics["tokens/sampled"] = float(sum(len(t.token_ids) for t in batch.trajectories))
    metrics["tokens/trained"] = (float(sum(len(t.token_ids) for t, _ in trained))
                                 - metrics.get("train/skipped_zero_adv_tokens", 0.0))

    # weights: version step + 1 to the engine(s). A stale batch is sampled from an older version: keep a copy the
    # optimizer will not touch.
    run.pipeline.publish_weights(step + 1, policy.weights(copy=recipe.pipeline.max_staleness > 0))
    _log_episodes(logs.episodes, batch)
    metrics.update(_batch_figures(batch, step, components, counts))
    metrics.update(_engine_figures(run.engine))
    metrics["time/step_s"] = time.perf_counter() - began
    # the process's CPU time (every thread): on a shared machine wall time also counts the other jobs
    metrics["time/step_cpu_s"] = time.process_time() - began_cpu

    # guard: the suites every N steps, the collapse alarms every step
    events: list[dict[str, Any]] = []
    if run.guard.evaluates_at(step + 1):
        eval_metrics, events = _evaluate(run, evaluate, step + 1, logs.events)
        metrics.update(eval_metrics)
    events += _report_events(run.guard.after_step(step + 1, metrics), logs.events)
    metrics.update(run.guard.metrics())
    metrics.update({f"guard/event/{event['kind']}": 1.0 for event in events})
    return metrics, events


def _returns(run: _Run, trajectories: list[Trajectory]) -> tuple[list[float], dict[str, list[float]]]:
    """Each episode's return (normalized per domain when the recipe asks) and its named components."""
    recipe = run.recipe
    returns, components = [], defaultdict(list)
    for trajectory in trajectories:
        learned = run.learned_reward.weighted(trajectory) if run.learned_reward is not None else None
        total, parts = episode_return(trajectory, recipe.returns, recipe.rollout.sampling.max_new_tokens, learned)
        returns.append(total)
        for name, value in parts.items():
            components[name].append(value)
    if recipe.algorithm.normalize_per_domain:
        returns = normalize_per_domain(returns, [t.domain for t in trajectories])
    return returns, components


def _engine_figures(engine: Any) -> dict[str, float]:
    """The built-in engine's speculative-decoding acceptance and tokens/s since the run started (when it drafts)."""
    stats = getattr(engine, "stats", None)
    if getattr(stats, "acceptance_rate", None) is None:
        return {}
    return {"rollout/spec_acceptance": stats.acceptance_rate, "rollout/engine_tokens_per_s": stats.tokens_per_s or 0.0}


def _batch_figures(batch: RolloutBatch, step: int, components: dict[str, list[float]], counts: dict[str, int]
                   ) -> dict[str, float]:
    metrics = {f"time/{k}": v for k, v in batch.timings.items()}
    metrics.update(batch_metrics(batch.trajectories))
    metrics.update({f"return/{k}": sum(v) / len(v) for k, v in components.items() if v})
    metrics.update({f"rollout/{k}": float(v) for k, v in counts.items()})
    metrics["policy/version"] = float(step)
    metrics["policy/staleness"] = float(step - batch.policy_version)
    metrics.update(batch_schedule_metrics(batch))
    return metrics


def _ppo_update(run: _Run, trajectories: list, returns: list[float], replay: list | None) -> dict[str, float]:
    """PPO with the critic: values before any update -> per-token GAE -> the policy's and the critic's updates."""
    algorithm = run.recipe.algorithm
    values = run.critic.values(trajectories)
    advantages, targets = gae_advantages(returns, values, algorithm.gamma, algorithm.lam)
    if algorithm.whiten_advantages:
        advantages = whiten(advantages)
    metrics = run.policy.update(trajectories, [a.tolist() for a in advantages], replay)
    metrics.update(run.critic.update(trajectories, values, targets))
    return metrics


# ---- the start of a run: the tokenizer, the self-test's tasks ------------------------------------------------

def starting_tokenizer(recipe: RLRecipe) -> Any:
    """The tokenizer of the model an RL run starts from: `model.path` (a local directory or a hub id), or the
    built-in tiny model.

    With `model.path` unset the run starts from a fresh built-in tiny model whose tokenizer is trained on the text of
    the recipe's domains (their prompts and, where a domain has them, demonstrations), so a packaged recipe runs as
    it is on a laptop. A fresh model knows nothing: its rewards start near zero, and the run exercises the pipeline
    (rollouts, verifiers, sandboxes, updates) rather than teaching much; start from a trained model
    (`model.path=runs/.../final`) to learn. The corpus is drawn with fixed seeds, so a resumed run trains the same
    tokenizer again."""
    if recipe.model.path is not None or recipe.model.tokenizer_path is not None:
        return load_tokenizer(recipe.model)
    say(f"[rl] model.path is unset: starting from a fresh built-in {recipe.model.preset} model (it has learned "
        "nothing yet; set model.path to a trained model to learn from the rewards)")
    return load_tokenizer(recipe.model, corpus=domain_corpus(recipe))


def domain_corpus(recipe: RLRecipe) -> list[str]:
    """Prompts and demonstrations of every domain of the recipe (train split, fixed seeds)."""
    texts: list[str] = []
    for spec in recipe.domains:
        source = get_domain(spec.name, **spec.args)
        for task in sample_tasks(source, CORPUS_TASKS_PER_DOMAIN, level=spec.levels, split="train", seed=11,
                                 unique=False):
            texts += [_text_of(m) for m in task.messages]
            try:
                sample = source.demonstration(task)
            except (TaskError, KeyError, NotImplementedError):
                continue  # a dataset without solutions: its prompts only
            texts += [_text_of(m) for m in sample.messages]
            texts.append(sample.metadata.reasoning_trace or "")
    return texts


def _text_of(message: dict[str, Any]) -> str:
    """A message's text: its string content, or its text parts (an image task's image part is no text)."""
    content = message.get("content") or ""
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _require_vision_support(recipe: RLRecipe, make_backend: BackendFactory) -> None:
    """What the image path does not take yet, refused before anything loads (docs/multimodal.md)."""
    unsupported = {
        "cluster.backend: images train in one process only (the local backend)":
            recipe.cluster.backend != "local" or make_backend is not local_backend,
        "algorithm.advantage: gae (the critic scores text only)": recipe.algorithm.advantage == "gae",
        "reward_model / process_reward_model (they score text only)":
            recipe.reward_model is not None or recipe.process_reward_model is not None,
        "runtime.compile: true": recipe.runtime.compile is True,
        "runtime.activation_checkpointing": recipe.runtime.activation_checkpointing,
        "rollout.engine: vllm (the built-in engine takes image prompts)": recipe.rollout.engine == "vllm",
    }
    refused = [what for what, hit in unsupported.items() if hit]
    if refused:
        raise ConfigError("model.vision: not supported with a vision-language policy yet: " + "; ".join(refused))


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
    extra_state = {"sampler": sampler_state, "pending": [batch.to_dict() for batch in pending],
                   "guard": copy.deepcopy(run.guard.state_dict())}
    write_extra = None
    if run.critic is not None:
        extra_state["critic"], write_extra = run.critic.state_dict(), run.critic.save_into_checkpoint
    write_checkpoint(run.output_dir, run.policy.full_model(), run.processor or run.tokenizer,
                     trainer_state=run.policy.state_dict(),
                     cursor=vars(cursor).copy(), keep=run.recipe.train.keep_checkpoints, extra_state=extra_state,
                     write_extra=write_extra)


def _log_episodes(handle, batch: RolloutBatch) -> None:
    for trajectory in batch.trajectories:
        handle.write(json.dumps(episode_record(trajectory, batch.index)) + "\n")
    handle.flush()


