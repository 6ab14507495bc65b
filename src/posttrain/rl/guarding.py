"""The trainer's side of the forgetting guard and the collapse alarms (`posttrain.schedule.guard`, `.alarms`).

`RunGuard` holds both, plus what only the trainer can know: which checkpoints were saved while the run was
healthy ("good"), how many rollbacks it took and the learning-rate scale they left. Its state goes into every
checkpoint; a rollback restores the guard from the checkpoint it returns to but keeps the rollback history
(count, lr scale, events), so the lower learning rate and the story of the run survive the rollback.

Also here: the regression suites and their greedy evaluation (`SuiteEvaluator`), the replay SFT loss a
regressed domain gets (`replay_sft_backward`: its gradient is accumulated before the RL update and the RL
update's optimizer step takes both), and `set_lr_scale`.
"""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from posttrain.config.rl import RLRecipe
from posttrain.data import Row, collate, tokenize_samples
from posttrain.data.schema import SFTSample
from posttrain.schedule import CollapseMonitor, ForgettingGuard, replay_samples
from posttrain.tasks import get_domain, sample_tasks
from posttrain.train.losses import sft_loss_sum
from posttrain.train.step import Runtime
from posttrain.types import SamplingParams, Task


def regression_suites(recipe: RLRecipe) -> dict[str, list[Task]]:
    """Suite name -> tasks: every domain's held-out items (named by the domain), then the general suites."""
    suites: dict[str, list[Task]] = {}
    for index, spec in enumerate(recipe.domains):
        if spec.heldout:
            suites[spec.name] = sample_tasks(get_domain(spec.name, **spec.args), spec.heldout, level=spec.levels,
                                             split="heldout", seed=recipe.runtime.seed + 1000 + index)
    for index, suite in enumerate(recipe.schedule.guard.suites):
        suites[suite.name] = sample_tasks(get_domain(suite.domain, **suite.args), suite.count, level=suite.levels,
                                          split="heldout", seed=recipe.runtime.seed + 2000 + index)
    return suites


def suite_metrics(recipe: RLRecipe, results: dict[str, float]) -> dict[str, float]:
    """``heldout/<domain>`` and ``heldout/mean`` for the domains' suites, ``regression/<name>`` for the general."""
    domains = {spec.name for spec in recipe.domains}
    heldout = {name: value for name, value in results.items() if name in domains}
    metrics = {f"heldout/{name}": value for name, value in heldout.items()}
    if heldout:
        metrics["heldout/mean"] = sum(heldout.values()) / len(heldout)
    metrics.update({f"regression/{name}": value for name, value in results.items() if name not in domains})
    return metrics


class SuiteEvaluator:
    """Greedy pass rate per suite, on an engine of its own (the rollout engine may be a version behind)."""

    def __init__(self, model, tokenizer, suites: dict[str, list[Task]], max_new_tokens: int, make_engine):
        self.model, self.tokenizer, self.suites = model, tokenizer, suites
        self.max_new_tokens, self._make_engine = max_new_tokens, make_engine
        self._engine = None

    def __call__(self, version: int) -> dict[str, float]:
        tasks = [task for suite in self.suites.values() for task in suite]
        if not tasks:
            return {}
        from posttrain.envs import run_episodes
        from posttrain.rollout import state_for_engine

        if self._engine is None:
            self._engine = self._make_engine()
        self._engine.update_weights(state_for_engine(self.model), version)
        sampling = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0)
        trajectories = run_episodes(self._engine, tasks, self.tokenizer, sampling)
        passed: dict[str, list[bool]] = defaultdict(list)
        names = [name for name, suite in self.suites.items() for _ in suite]
        for name, trajectory in zip(names, trajectories):
            passed[name].append(trajectory.reward.passed)
        return {name: sum(v) / len(v) for name, v in passed.items()}


class RunGuard:
    def __init__(self, recipe: RLRecipe, suites: dict[str, list[Task]]):
        self.recipe = recipe
        self.config = recipe.schedule
        mixed = {spec.name for spec in recipe.domains}
        suite_domains = {name: name for name in suites if name in mixed}
        suite_domains.update({s.name: s.domain if s.domain in mixed else None for s in self.config.guard.suites
                              if s.name in suites})
        self.forgetting = ForgettingGuard(self.config.guard, suite_domains)
        self.monitor = CollapseMonitor(self.config.alarms)
        self.has_suites = bool(suites)
        self.rollbacks = 0
        self.lr_scale = 1.0
        self.good_steps: list[int] = []
        self.events: list[dict[str, Any]] = []
        specs = {spec.name: (spec.name, spec.args, spec.levels) for spec in recipe.domains}
        specs.update({s.name: (s.domain, s.args, s.levels) for s in self.config.guard.suites})
        self._replay_specs = specs
        self._replay_sources: dict[str, tuple[Any, list[int]]] = {}

    # ---- evaluations ------------------------------------------------------------------------------------

    def evaluates_at(self, step: int) -> bool:
        every = self.recipe.train.eval_every
        guard_every = self.config.guard.every if self.config.guard.enabled else None
        return bool(self.has_suites and any(n and step % n == 0 for n in (every, guard_every)))

    def wants_baseline(self) -> bool:
        guard = self.config.guard
        return bool(self.has_suites and guard.enabled and guard.baseline and (guard.every or self.recipe.train.eval_every))

    def after_eval(self, step: int, results: dict[str, float]) -> list[dict[str, Any]]:
        events = self.forgetting.update(step, results) if self.config.guard.enabled else []
        domains = [results[spec.name] for spec in self.recipe.domains if spec.name in results]
        if domains:
            events += self.monitor.observe_eval(step, sum(domains) / len(domains))
        return self._record(events)

    # ---- every step ---------------------------------------------------------------------------------------

    def after_step(self, step: int, metrics: dict[str, float]) -> list[dict[str, Any]]:
        return self._record(self.monitor.observe_step(step, metrics))

    def replay_batch(self, step: int) -> list[SFTSample]:
        suites = self.forgetting.replay_suites()
        if not suites:
            return []
        rng = random.Random(f"replay:{self.recipe.runtime.seed}:{step}:{self.rollbacks}")
        return replay_samples([self._replay_source(suite) for suite in suites], self.config.guard.replay_samples, rng)

    def metrics(self) -> dict[str, float]:
        out = {"guard/regressed": float(len(self.forgetting.regressed)), "guard/rollbacks": float(self.rollbacks),
               "guard/lr_scale": self.lr_scale}
        out.update({f"guard/regressed/{suite}": 1.0 for suite in self.forgetting.regressed})
        return out

    # ---- rollbacks ----------------------------------------------------------------------------------------

    def should_roll_back(self, alarms: list[dict[str, Any]]) -> bool:
        alarms_config = self.config.alarms
        return bool(alarms) and alarms_config.action == "rollback" and self.rollbacks < alarms_config.max_rollbacks

    def mark_saved(self, step: int, alarms: list[dict[str, Any]]) -> None:
        if not alarms:
            self.good_steps.append(step)

    def rollback_target(self, output_dir: Path) -> tuple[Path | None, int | None]:
        """The newest good checkpoint still on disk (older ones are pruned by `keep_checkpoints`) and its step."""
        for step in sorted(self.good_steps, reverse=True):
            path = Path(output_dir) / "checkpoints" / f"step-{step:06d}"
            if path.is_dir():
                return path, step
        return None, None

    def begin_rollback(self, step: int, target_step: int | None) -> dict[str, Any]:
        self.rollbacks += 1
        self.lr_scale *= self.config.alarms.lr_decay
        if target_step is not None:
            self.good_steps = [s for s in self.good_steps if s <= target_step]
        kind = "rollback" if target_step is not None else "lr_decrease"
        return self._record([{"kind": kind, "step": step, "to_step": target_step, "lr_scale": self.lr_scale,
                              "rollbacks": self.rollbacks}])[0]

    # ---- state ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"forgetting": self.forgetting.state_dict(), "monitor": self.monitor.state_dict(),
                "rollbacks": self.rollbacks, "lr_scale": self.lr_scale, "good_steps": list(self.good_steps),
                "events": [dict(e) for e in self.events]}

    def load_state_dict(self, state: dict[str, Any], *, keep_history: bool = False) -> None:
        """Restore; with `keep_history` (a rollback) the rollback count, lr scale, good steps and events stay."""
        self.forgetting.load_state_dict(state["forgetting"])
        self.monitor.load_state_dict(state["monitor"])
        if not keep_history:
            self.rollbacks, self.lr_scale = state["rollbacks"], state["lr_scale"]
            self.good_steps, self.events = list(state["good_steps"]), [dict(e) for e in state["events"]]

    def _record(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.events += events
        return events

    def _replay_source(self, suite: str) -> tuple[Any, list[int]]:
        if suite not in self._replay_sources:
            name, args, levels = self._replay_specs[suite]
            self._replay_sources[suite] = (get_domain(name, **args), list(levels))
        return self._replay_sources[suite]


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
