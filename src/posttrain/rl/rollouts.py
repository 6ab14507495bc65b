"""The rollout side of an RL step: tasks from the scheduler -> groups of episodes -> dynamic sampling -> a batch.

`BatchProducer(index, version)` is the `rl.pipeline` producer. Per batch it asks the task sampler for
`prompts_per_step` tasks, rolls out a group of episodes for each (`RolloutFn`: the engine, the environments and
the verifiers), lets the sampler observe them, and sorts the groups (`posttrain.schedule.groups`):

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
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from dataclasses import replace
from typing import Any, Callable

from posttrain.config.rl import DynamicSamplingConfig, RLRecipe
from posttrain.rl.pipeline import RolloutBatch
from posttrain.schedule import DROPPED_KEY, TaskSampler, group_outcome, is_kept, split_groups
from posttrain.types import SamplingParams, Task, Trajectory

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


def engine_rollout(engine: Any, tokenizer: Any, recipe: RLRecipe) -> RolloutFn:
    """Groups of `group_size` episodes per task through the engine (batched by an `AsyncBatcher`)."""
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
            )

    def run(tasks: list[Task], sampling: SamplingParams) -> list[Trajectory]:
        return asyncio.run(collect(tasks, sampling))

    return run


def sampling_params(recipe: RLRecipe) -> SamplingParams:
    sampling = recipe.rollout.sampling
    return SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                          top_p=sampling.top_p, top_k=sampling.top_k)
