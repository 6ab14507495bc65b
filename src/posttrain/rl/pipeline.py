"""The rollout side of the RL loop: batches of episodes produced ahead of training, with a bounded and
*deterministic* staleness, and what the loop records of each batch.

**The pipeline** (`RolloutPipeline`). The trainer takes step k on batch k. With `max_staleness = s`, batch k is
sampled with the weights of policy version max(k - s, first) — exactly that version, not "whatever is newest":
the trainer publishes a snapshot of its weights after every step (`publish_weights`), and the producer swaps
them into the engine only between batches, waiting for the version it needs. So:

* s = 0 is the synchronous on-policy loop (batch k waits for the weights of step k - 1);
* s >= 1 lets the producer sample batch k while the trainer trains on batch k - 1 (generation and training
  overlap; on one machine each side gets its share of the CPU threads);
* for any s, the overlapped run and the inline run (`overlap=False`) compute the same batches from the same
  weights, bit for bit, because nothing depends on timing: sampling seeds derive from (seed, k), the task
  sampler is advanced only by the producer, batch by batch, and weight versions are fixed per batch.

`checkpoint_state()` holds the producer between batches and returns what it has produced and not yet handed
over, with the sampler's state at that moment; a checkpoint stores both, so a resumed run continues the same
stream.

**A batch** (`BatchProducer(index, version)`, the pipeline's producer): tasks from the scheduler -> groups of
episodes -> dynamic sampling. Per batch it asks the task sampler for `prompts_per_step` tasks, rolls out a group
of episodes for each (`RolloutFn`: the engine, the environments and the verifiers), lets the sampler observe
them, and sorts the groups (`posttrain.schedule.groups`):

* a group with reward spread reaches the trainer;
* a group whose scores are all equal carries no signal: with `dynamic_sampling.mode = drop` it is dropped and
  the batch refilled (the sampler sends the refill to the domains short of their share), at most
  `max_extra_groups * prompts_per_step` extra groups over at most `max_rounds` rounds, so a batch can come out
  short (counted); with ``keep`` it is trained on with zero advantage;
* a group with no episode left after the episode loop's own infrastructure retries is dropped; the sampler
  re-queues its task (`schedule.infra_requeues`), and a refill replaces it.

Dropped groups stay in the batch, marked in ``metadata["dropped"]``: the trainer skips them and the episode log
(the data flywheel) keeps them. Each round samples with its own seed derived from (seed, index, round), and
after a rollback from the attempt number too, so the batch is a pure function of the run's history.

**Records.** `select_trainable` drops what must not be trained on (infrastructure failures, dropped groups,
stale trajectories); `batch_metrics`, `episode_record` and `describe_event` are what the loop logs.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from posttrain.config import DynamicSamplingConfig, RLRecipe
from posttrain.envs import episode_policy_tokens, judging_wall_seconds, oldest_policy_version
from posttrain.rl.learned import LEARNED_REWARD_KEY
from posttrain.schedule import DROPPED_KEY, TaskSampler, group_outcome, is_dropped, is_kept, split_groups
from posttrain.types import FailureClass, SamplingParams, Task, Trajectory

@dataclass
class RolloutBatch:
    index: int  # the training step this batch feeds
    policy_version: int  # the engine weights it was sampled with
    trajectories: list[Trajectory]
    timings: dict[str, float] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "policy_version": self.policy_version,
            "trajectories": [t.to_dict() for t in self.trajectories],
            "timings": self.timings,
            "stats": self.stats,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutBatch:
        return cls(
            index=data["index"],
            policy_version=data["policy_version"],
            trajectories=[Trajectory.from_dict(t) for t in data["trajectories"]],
            timings=dict(data.get("timings", {})),
            stats=dict(data.get("stats", {})),
        )


# produce(index, version) -> the batch for step `index`, sampled with the engine at `version`
Producer = Callable[[int, int], RolloutBatch]
# apply_weights(state, version) -> seconds it took (the engine's in-memory update)
WeightSink = Callable[[dict[str, Any], int], float]


class RolloutPipeline:
    def __init__(
        self,
        produce: Producer,
        apply_weights: WeightSink,
        *,
        max_staleness: int,
        overlap: bool,
        start_index: int,
        start_version: int,
        engine_version: int,
        pending: list[RolloutBatch] | None = None,
        thread_setup: Callable[[], None] | None = None,
    ):
        self._produce = produce
        self._apply_weights = apply_weights
        self.max_staleness = max_staleness
        self.overlap = overlap
        self._first_version = start_version
        self._engine_version = engine_version
        self._weights: dict[int, dict[str, Any]] = {}
        self._ready: dict[int, RolloutBatch] = {batch.index: batch for batch in pending or []}
        self._next_index = start_index  # the next batch the trainer asks for
        self._next_to_produce = max([start_index - 1, *self._ready]) + 1
        self._condition = threading.Condition()
        self._producing = threading.Lock()  # held while a batch is being produced
        self._error: BaseException | None = None
        self._closed = False
        self._thread_setup = thread_setup
        self._thread: threading.Thread | None = None
        if overlap:
            self._thread = threading.Thread(target=self._run, name="posttrain-rollout-producer", daemon=True)
            self._thread.start()

    # ---- the trainer's side ----------------------------------------------------------------------------

    def publish_weights(self, version: int, state: dict[str, Any]) -> None:
        """Make `state` (a snapshot the trainer will not modify) available as policy `version`."""
        with self._condition:
            self._weights[version] = state
            self._condition.notify_all()

    def next_batch(self) -> RolloutBatch:
        """The batch for the trainer's next step (produced inline when not overlapping); timings['wait_s']
        is how long the trainer waited for it."""
        index = self._next_index
        started = time.perf_counter()
        if not self.overlap and index not in self._ready:
            self._produce_one(index)
        with self._condition:
            while index not in self._ready:
                if self._error is not None:
                    raise RuntimeError("the rollout producer failed") from self._error
                self._condition.wait(timeout=1.0)
            batch = self._ready.pop(index)
            self._next_index += 1
            self._forget_old_weights()
            self._condition.notify_all()
        batch.timings["wait_s"] = time.perf_counter() - started
        return batch

    def checkpoint_state(self, save_sampler: Callable[[], Any]) -> tuple[list[RolloutBatch], Any]:
        """Produced-but-unconsumed batches and `save_sampler()`, both taken between two batches (the producer
        is held), so a resumed run continues the same stream of batches."""
        with self._producing:
            with self._condition:
                pending = [self._ready[i] for i in sorted(self._ready)]
            return pending, save_sampler()

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    # ---- the producer's side ---------------------------------------------------------------------------

    def version_for(self, index: int) -> int:
        return max(index - self.max_staleness, self._first_version)

    def _run(self) -> None:
        if self._thread_setup is not None:
            self._thread_setup()
        try:
            while True:
                with self._condition:
                    index = self._next_to_produce
                    # Stay at most max_staleness + 1 batches ahead of the trainer.
                    while not self._closed and index > self._next_index + self.max_staleness:
                        self._condition.wait()
                    if self._closed:
                        return
                self._produce_one(index)
        except BaseException as error:  # noqa: BLE001 - handed to the trainer, which raises it
            with self._condition:
                self._error = error
                self._condition.notify_all()

    def _produce_one(self, index: int) -> None:
        version = self.version_for(index)
        with self._condition:
            while version not in self._weights and version != self._engine_version:
                if self._closed:
                    return
                self._condition.wait()
            state = self._weights.get(version)
        with self._producing:
            sync_s = 0.0
            if version != self._engine_version:
                sync_s = self._apply_weights(state, version)
                self._engine_version = version
            batch = self._produce(index, version)
            batch.timings["weight_sync_s"] = sync_s
            with self._condition:
                self._ready[index] = batch
                self._next_to_produce = index + 1
                self._condition.notify_all()

    def _forget_old_weights(self) -> None:
        needed = self.version_for(min([self._next_to_produce, self._next_index]))
        for version in [v for v in self._weights if v < needed and v != self._engine_version]:
            del self._weights[version]


# ---- one batch: tasks -> groups of episodes -> dynamic sampling ----------------------------------------

# rollout(tasks, sampling) -> a group of episodes per task, in task order, each group contiguous
RolloutFn = Callable[[list[Task], SamplingParams], list[Trajectory]]


class BatchProducer:
    def __init__(self, rollout: RolloutFn, sampler: TaskSampler, *, prompts_per_step: int, sampling: SamplingParams,
                 seed: int, dynamic: DynamicSamplingConfig, attempt: int = 0):
        self.rollout, self.sampler = rollout, sampler
        self.prompts_per_step, self.sampling, self.seed = prompts_per_step, sampling, seed
        self.dynamic, self.attempt = dynamic, attempt

    def __call__(self, index: int, version: int) -> RolloutBatch:
        started = time.perf_counter()
        target = self.prompts_per_step
        budget = int(self.dynamic.max_extra_groups * target)
        counts: Counter[str] = Counter()
        trajectories: list[Trajectory] = []
        self.sampler.begin_batch(index)
        tasks, rounds, extra = self.sampler.next_batch(target), 0, 0
        while tasks:
            sampling = replace(self.sampling, seed=batch_seed(self.seed, index, rounds, self.attempt))
            produced = self.rollout(tasks, sampling)
            self.sampler.observe(produced, index)
            self._sort(produced, counts)
            trajectories += produced
            rounds += 1
            missing = target - counts["kept"]
            more = min(missing, budget - extra)
            if missing <= 0 or rounds >= self.dynamic.max_rounds or more <= 0:
                break
            extra += more
            tasks = self.sampler.refill(more)
        counts["rounds"], counts["refill_groups"] = rounds, extra
        counts["short"] = max(0, target - counts["kept"])
        counts["infra_retried_episodes"] = sum(t.metadata.get("attempts", 1) > 1 for t in trajectories)
        return RolloutBatch(index, version, trajectories, timings={"rollout_s": time.perf_counter() - started},
                            stats={"dynamic": dynamic_metrics(counts), "schedule": self.sampler.report()})

    def _sort(self, produced: list[Trajectory], counts: Counter[str]) -> None:
        for group in split_groups(produced):
            outcome = group_outcome(group)
            counts["groups"] += 1
            counts[outcome] += 1
            if is_kept(outcome, self.dynamic.mode):
                counts["kept"] += 1
                continue
            counts[f"dropped_{outcome}"] += 1
            for trajectory in group:
                trajectory.metadata[DROPPED_KEY] = outcome


def dynamic_metrics(counts: Counter[str]) -> dict[str, float]:
    out = {key: float(counts[key]) for key in ("groups", "kept", "signal", "zero_spread", "dropped_zero_spread",
                                                "infra", "refill_groups", "rounds", "short",
                                                "infra_retried_episodes")}
    scored = counts["groups"] - counts["infra"]
    if scored:
        out["signal_share"] = counts["signal"] / scored
    return out


def batch_seed(seed: int, index: int, round_index: int = 0, attempt: int = 0) -> int:
    """The sampling seed of one generation round; round 0 of the first attempt keeps the plain (seed, index) key."""
    key = f"rl:{seed}:{index}" if round_index == 0 and attempt == 0 else f"rl:{seed}:{index}:{round_index}:{attempt}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big")


def engine_rollout(engine: Any, tokenizer: Any, recipe: RLRecipe, renderer: Any = None) -> RolloutFn:
    """Groups of `group_size` episodes per task through the engine (batched by an `AsyncBatcher`); image prompts
    through `renderer` (a `envs.PromptRenderer`: `rl.vision.ProcessorRenderer`)."""
    rollout = recipe.rollout
    rollout_inline = recipe.pipeline.max_staleness == 0

    async def collect(tasks: list[Task], sampling: SamplingParams) -> list[Trajectory]:
        from posttrain.envs import rollout_many
        from posttrain.rollout import AsyncBatcher

        # Synchronous (nothing to overlap): the engine samples on this thread, the one that owns its OpenMP team.
        async with AsyncBatcher(engine, inline=rollout_inline) as batcher:
            return await rollout_many(
                batcher, tasks, tokenizer, sampling, n=rollout.sampling.group_size,
                max_concurrency=rollout.max_concurrent_episodes, infra_retries=rollout.infra_retries,
                renderer=renderer,
            )

    def run(tasks: list[Task], sampling: SamplingParams) -> list[Trajectory]:
        return asyncio.run(collect(tasks, sampling))

    return run


def sampling_params(recipe: RLRecipe) -> SamplingParams:
    sampling = recipe.rollout.sampling
    return SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                          top_p=sampling.top_p, top_k=sampling.top_k)


# ---- what the loop records of a batch ------------------------------------------------------------------

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
        if episode_policy_tokens(trajectory) == 0:
            continue
        # Every segment's versions: a black-box agent's earlier segment may be older than its last.
        if step - oldest_policy_version(trajectory) > recipe.pipeline.max_staleness:
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
        metrics["rollout/policy_tokens"] = sum(episode_policy_tokens(t) for t in scored) / len(scored)
        metrics["rollout/truncated"] = sum(t.truncated for t in scored) / len(scored)
        metrics["rollout/steps"] = sum(t.steps for t in scored) / len(scored)
        calls = sum(t.tool_calls for t in scored)
        if calls:
            metrics["rollout/tool_call_success"] = sum(t.tool_calls_ok for t in scored) / calls
    for domain, group in by_domain.items():
        metrics[f"reward/{domain}"] = sum(t.reward.score for t in group) / len(group)
        metrics[f"pass_rate/{domain}"] = sum(t.reward.passed for t in group) / len(group)
        metrics[f"time/judge_s/{domain}"] = judging_wall_seconds(group)  # wall time its verifiers were busy
    metrics["time/judge_s"] = judging_wall_seconds(trajectories)
    failures: dict[str, int] = defaultdict(int)
    for trajectory in trajectories:
        if trajectory.reward.failure is not FailureClass.NONE:
            failures[trajectory.reward.failure.value] += 1
    metrics.update({f"failures/{k}": float(v) for k, v in failures.items()})
    return metrics


def episode_record(trajectory: Trajectory, step: int) -> dict[str, Any]:
    """What the data flywheel keeps of an episode: the transcript, the verdict, and where it came from (and, when
    the recipe has a learned reward component and the episode was trained on, the reward model's score)."""
    record = {
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
        "policy_version": oldest_policy_version(trajectory),
        "dropped": trajectory.metadata.get(DROPPED_KEY),  # why the group did not reach the trainer, if it did not
    }
    if LEARNED_REWARD_KEY in trajectory.metadata:
        record[LEARNED_REWARD_KEY] = trajectory.metadata[LEARNED_REWARD_KEY]
    return record


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
