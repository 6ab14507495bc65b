"""The RL stage's task scheduler: mixing, curriculum, priority sampling, dedup and infrastructure retries.

One batch, as the rollout producer drives it (`posttrain.rl.pipeline.BatchProducer`):

    scheduler.begin_batch(index)          # guard directives due at `index` take effect
    tasks = scheduler.next_batch(P)       # P groups, split over domains by target / keep rate
    scheduler.observe(trajectories, index)
    more = scheduler.refill(k)            # groups were dropped: k more, to the domains short of their count
    scheduler.observe(more_trajectories, index)

Per batch the target shares (`mixing.DomainMixer.target`) are turned into per-domain group counts (largest
remainder); the first draw samples each domain in proportion to ``target / keep_rate`` and every refill goes to
the domains whose kept groups are still below their count, so the shares that reach the trainer hold even when
one domain's groups are mostly filtered. Within a domain a task comes from the retry queue (tasks whose group
was lost to infrastructure failures, re-queued at most `infra_requeues` times; a model failure never is), or
from the domain's candidate pool by priority (`curriculum.TaskPool`), or is a fresh draw at the domain's
curriculum level. A task drawn at batch i is not drawn again before batch i + `dedup_window` (fresh draws that
collide are redrawn, counted).

Everything random comes from one seeded `random.Random` advanced only here, by the producer, batch by batch;
`state_dict` holds all of it (plain data), so a resumed run draws exactly what the uninterrupted one would have.
The one input from the trainer's side, the forgetting guard's boosts, arrives as a directive tagged with the
batch index it takes effect at (`boost_domains`), never "whenever the producer looks".
"""

from __future__ import annotations

import random
import threading
from typing import Any, Sequence

from posttrain.config import DomainConfig, ScheduleConfig
from posttrain.schedule.curriculum import LevelController, TaskPool
from posttrain.schedule.groups import group_outcome, is_kept, scored_members, split_groups
from posttrain.schedule.mixing import DomainMixer
from posttrain.schedule.sampler import apportion, as_rng_state, draw_task, rng_state_data
from posttrain.schedule.stats import TaskStatsStore
from posttrain.tasks import TaskError, get_domain
from posttrain.types import Task, Trajectory

DEDUP_TRIES = 20  # fresh draws before accepting a task seen within the window (a small finite level)
_BATCH_COUNTS = ("groups", "kept", "signal", "episodes", "passes")


class Scheduler:
    """A `TaskSampler` over the recipe's domains, configured by the recipe's `schedule` section."""

    def __init__(self, domains: Sequence[DomainConfig], config: ScheduleConfig | None = None, seed: int = 0):
        self.config = config = config or ScheduleConfig()
        self.specs = {spec.name: spec for spec in domains}
        self.sources = {name: get_domain(name, **spec.args) for name, spec in self.specs.items()}
        for name, spec in self.specs.items():
            if not spec.levels or not all(1 <= level <= self.sources[name].max_level for level in spec.levels):
                raise TaskError(f"domain '{name}': levels {spec.levels} must lie in 1..{self.sources[name].max_level}")
        self.rng = random.Random(seed)
        self.stats = TaskStatsStore(config.stats_ema, config.max_tracked_tasks)
        self.mixer = DomainMixer({n: s.weight for n, s in self.specs.items()}, config.mixing, config.guard)
        self.levels = {n: LevelController(s.levels, config.curriculum, config.curriculum.start.get(n))
                       for n, s in self.specs.items()}
        self.level_pass: dict[str, dict[int, float]] = {name: {} for name in self.specs}  # moving pass rates
        self.pools = {name: TaskPool(config.priority) for name in self.specs}
        self.recent: dict[str, int] = {}  # task id -> the batch it was last drawn in
        self.retry_queue: list[dict[str, Any]] = []  # {"domain", "task" (dict), "requeues"}
        self.directives: list[list[Any]] = []  # [from_index, boosted domains], posted by the trainer
        self.counters = {key: 0 for key in ("dedup_redraws", "dedup_exhausted", "infra_groups", "infra_requeued",
                                            "infra_gave_up", "level_up", "level_down")}
        self.sampled = {name: 0 for name in self.specs}  # groups drawn, all batches
        self.trained = {name: 0 for name in self.specs}  # groups that reached the trainer
        self._lock = threading.Lock()  # guards `directives` (the trainer posts while the producer draws)
        self._begun = False
        self._new_batch(-1)

    # ---- the TaskSampler contract ---------------------------------------------------------------------

    def begin_batch(self, index: int) -> None:
        self._fold_batch()
        self._new_batch(index)
        with self._lock:
            due = [d for d in self.directives if d[0] <= index]
            self.directives = [d for d in self.directives if d[0] > index]
        if due:
            self.mixer.boosted = list(due[-1][1])
        window = self.config.dedup_window
        self.recent = {task_id: seen for task_id, seen in self.recent.items() if index - seen < window}
        self._begun = True

    def next_batch(self, count: int) -> list[Task]:
        """The first `count` tasks (groups) of a batch."""
        if not self._begun:
            self.begin_batch(self.batch["index"] + 1)
        self._begun = False
        targets = self.mixer.target(self.batch["index"])
        self.batch["targets"] = targets
        self.batch["target_counts"] = apportion(targets, count, self.rng)
        return self._draw(apportion(self.mixer.sampling_weights(targets), count, self.rng))

    def refill(self, count: int) -> list[Task]:
        """`count` more tasks for the current batch, to the domains whose kept groups are short of their count."""
        wanted = self.batch["target_counts"]
        deficit = {name: max(0, wanted[name] - self.batch["kept"].get(name, 0)) for name in wanted}
        if not any(deficit.values()):
            deficit = dict(self.batch["targets"])
        return self._draw(apportion(self.mixer.sampling_weights(deficit), count, self.rng))

    def observe(self, trajectories: Sequence[Trajectory], step: int) -> None:
        """Fold the verified groups of the current batch into the statistics, curricula, pools and counts."""
        mode = self.config.dynamic_sampling.mode
        for group in split_groups(trajectories):
            first = group[0]
            drawn = self.batch["tasks"].get(first.task_id)
            name = drawn["domain"] if drawn else (first.domain if first.domain in self.specs else None)
            if name is None:
                continue
            outcome = group_outcome(group)
            members = scored_members(group)
            if members:
                self._learn(name, first, members, outcome, step)
            lost_to_infra = len(members) < len(group)
            self.counters["infra_groups"] += lost_to_infra
            if is_kept(outcome, mode):
                self._count(name, "kept")
                self.trained[name] += 1
            elif lost_to_infra:
                self.pools[name].discard(first.task_id)
                if drawn is not None:
                    self._requeue(name, drawn)

    def report(self) -> dict[str, float]:
        out: dict[str, float] = {}
        sampled, trained = max(1, sum(self.sampled.values())), sum(self.trained.values())
        for name in self.specs:
            controller = self.levels[name]
            out[f"curriculum/{name}"] = float(controller.level)
            out[f"curriculum/peak/{name}"] = float(controller.peak)
            if controller.pass_rate() is not None:
                out[f"curriculum/pass_rate/{name}"] = controller.pass_rate()
            out[f"mix/target/{name}"] = self.batch["targets"].get(name, 0.0)
            out[f"mix/sampled/{name}"] = self.sampled[name] / sampled
            if trained:
                out[f"mix/trained/{name}"] = self.trained[name] / trained
            if self.mixer.keep_rate[name] is not None:
                out[f"schedule/keep_rate/{name}"] = self.mixer.keep_rate[name]
            out[f"schedule/retired/{name}"] = float(len(self.pools[name].retired))
        pool_counts = {key: sum(pool.counts[key] for pool in self.pools.values())
                       for key in next(iter(self.pools.values())).counts}
        out.update({f"schedule/{key}": float(value) for key, value in {**self.counters, **pool_counts}.items()})
        out["schedule/tracked_tasks"] = float(len(self.stats))
        return out

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            directives = [[index, list(names)] for index, names in self.directives]
        return {
            "rng": rng_state_data(self.rng),
            "stats": self.stats.state_dict(),
            "mixer": self.mixer.state_dict(),
            "levels": {name: controller.state_dict() for name, controller in self.levels.items()},
            "level_pass": {name: {str(k): v for k, v in rates.items()} for name, rates in self.level_pass.items()},
            "pools": {name: pool.state_dict() for name, pool in self.pools.items()},
            "recent": dict(self.recent),
            "retry_queue": [dict(entry) for entry in self.retry_queue],
            "directives": directives,
            "counters": dict(self.counters),
            "sampled": dict(self.sampled),
            "trained": dict(self.trained),
            "begun": self._begun,
            "batch": {**self.batch, "tasks": {k: dict(v) for k, v in self.batch["tasks"].items()}},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.setstate(as_rng_state(state["rng"]))
        self.stats.load_state_dict(state["stats"])
        self.mixer.load_state_dict(state["mixer"])
        for name, controller in self.levels.items():
            controller.load_state_dict(state["levels"][name])
        self.level_pass = {name: {int(k): v for k, v in rates.items()} for name, rates in state["level_pass"].items()}
        for name, pool in self.pools.items():
            pool.load_state_dict(state["pools"][name])
        self.recent = dict(state["recent"])
        self.retry_queue = [dict(entry) for entry in state["retry_queue"]]
        with self._lock:
            self.directives = [[index, list(names)] for index, names in state["directives"]]
        self.counters, self.sampled, self.trained = dict(state["counters"]), dict(state["sampled"]), dict(state["trained"])
        self._begun = state["begun"]
        batch = state["batch"]
        self.batch = {**batch, "tasks": {k: dict(v) for k, v in batch["tasks"].items()}}

    # ---- what the trainer's side may ask -----------------------------------------------------------------

    def boost_domains(self, domains: Sequence[str], from_index: int) -> None:
        """From batch `from_index` on, the forgetting guard's regressed `domains` get boosted shares (this
        replaces the previous set). Safe to call while the producer draws."""
        with self._lock:
            self.directives.append([from_index, [name for name in domains if name in self.specs]])

    def levels_now(self) -> dict[str, int]:
        return {name: controller.level for name, controller in self.levels.items()}

    # ---- drawing ----------------------------------------------------------------------------------------

    def _draw(self, allocation: dict[str, int]) -> list[Task]:
        tasks = []
        for name, count in allocation.items():
            for _ in range(count):
                task, requeues = self._pop_retry(name)
                task = task or self._from_pool(name)
                tasks.append(task)
                self.sampled[name] += 1
                self.recent[task.id] = self.batch["index"]
                self.batch["tasks"][task.id] = {"domain": name, "requeues": requeues, "task": task.to_dict()}
        return tasks

    def _from_pool(self, name: str) -> Task:
        return self.pools[name].draw(self.rng, lambda: self._fresh(name), self._eligible,
                                     lambda task: self._pass_rate(name, task))

    def _pop_retry(self, name: str) -> tuple[Task | None, int]:
        for position, entry in enumerate(self.retry_queue):
            if entry["domain"] == name:
                del self.retry_queue[position]
                return Task.from_dict(entry["task"]), entry["requeues"]
        return None, 0

    def _fresh(self, name: str) -> Task:
        spec, pool, controller = self.specs[name], self.pools[name], self.levels[name]
        for _ in range(DEDUP_TRIES):
            level = self._fresh_level(spec, controller)
            task = draw_task(self.sources[name], level, self.rng)
            if task.id not in pool and self._eligible(task):
                return task
            self.counters["dedup_redraws"] += 1
        self.counters["dedup_exhausted"] += 1
        return task

    def _fresh_level(self, spec: DomainConfig, controller: LevelController) -> int:
        curriculum = self.config.curriculum
        if not curriculum.enabled:
            return self.rng.choice(spec.levels)
        below = [level for level in controller.levels if level < controller.level]
        if curriculum.review > 0 and below and self.rng.random() < curriculum.review:
            return self.rng.choice(below)
        return controller.level

    def _eligible(self, task: Task) -> bool:
        window = self.config.dedup_window
        last = self.recent.get(task.id)
        return window == 0 or last is None or self.batch["index"] - last >= window

    def _pass_rate(self, name: str, task: Task) -> float:
        """A task's measured pass rate; for a task never seen, its level's so far (or the prior)."""
        stats = self.stats.get(task.id)
        if stats is not None:
            return stats.pass_ema
        return self.level_pass[name].get(task.difficulty, self.config.priority.prior)

    # ---- observing --------------------------------------------------------------------------------------

    def _learn(self, name: str, first: Trajectory, members: list[Trajectory], outcome: str, step: int) -> None:
        passed = [t.reward.passed for t in members]
        stats = self.stats.record(first.task_id, name, first.difficulty, [t.reward.score for t in members], passed,
                                  step)
        rate = sum(passed) / len(passed)
        rates = self.level_pass[name]
        old = rates.get(first.difficulty)
        rates[first.difficulty] = rate if old is None else self.config.stats_ema * old + (1 - self.config.stats_ema) * rate
        move = self.levels[name].observe(first.difficulty, passed)
        if move:
            self.counters["level_up" if move > 0 else "level_down"] += 1
            self.pools[name].keep_only_level(self.levels[name].level)
        self.pools[name].observe(first.task_id, stats)
        self._count(name, "groups")
        self._count(name, "signal", outcome == "signal")
        self._count(name, "episodes", len(members))
        self._count(name, "passes", sum(passed))

    def _requeue(self, name: str, drawn: dict[str, Any]) -> None:
        if drawn["requeues"] < self.config.infra_requeues:
            self.retry_queue.append({"domain": name, "task": drawn["task"], "requeues": drawn["requeues"] + 1})
            self.counters["infra_requeued"] += 1
        else:
            self.counters["infra_gave_up"] += 1

    def _count(self, name: str, key: str, amount: int = 1) -> None:
        self.batch[key][name] = self.batch[key].get(name, 0) + int(amount)

    def _new_batch(self, index: int) -> None:
        self.batch = {"index": index, "targets": getattr(self, "batch", {}).get("targets", {}),
                      "target_counts": {}, "tasks": {}, **{key: {} for key in _BATCH_COUNTS}}

    def _fold_batch(self) -> None:
        batch = self.batch
        if batch["groups"]:
            self.mixer.observe_batch(batch["groups"], batch["kept"], batch["signal"], batch["episodes"],
                                     batch["passes"])
