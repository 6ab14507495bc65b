"""The trainer's side of the forgetting guard and the collapse alarms (`posttrain.schedule.guard`, `.alarms`).

`RunGuard` holds both, plus what only the trainer can know: which checkpoints were saved while the run was
healthy ("good"), how many rollbacks it took and the learning-rate scale they left. Its state goes into every
checkpoint; a rollback restores the guard from the checkpoint it returns to but keeps the rollback history
(count, lr scale, events), so the lower learning rate and the story of the run survive the rollback.

What it watches (`regression_suites`: every domain's held-out items and the recipe's general suites) is evaluated
through `posttrain.evaluate` (`suite_evaluator` -> a `SuiteEvaluator`, ``evaluate(model, version)``: the same
episodes and pass@1 as `posttrain eval`; `eval_metrics_of` names the figures the run logs). A suite's pass rate is
over its scored episodes only, so an infrastructure failure (a sandbox, the engine, a verifier) can neither lower
it nor trip the guard; a suite with nothing scored is skipped at that evaluation. The replay SFT loss the guard asks
for is the policy's (`rl.update.replay_sft_backward`), as is the learning-rate scale a rollback leaves
(`Optimization.set_lr_scale`).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable, Sequence

from posttrain.config import EvalRuntime, EvalSampling, RLRecipe
from posttrain.data import SFTSample
from posttrain.evaluate import Suite, SuiteEvaluator, SuiteScore, regression_suite, tasks_suite
from posttrain.rl.backend import make_engine
from posttrain.schedule import CollapseMonitor, ForgettingGuard, replay_samples
from posttrain.tasks import get_domain, sample_tasks
from posttrain.train import Runtime


# evaluate(model, version) -> suite name -> its score (posttrain.evaluate.SuiteEvaluator)
EvaluateFn = Callable[[Any, int], dict[str, SuiteScore]]


def regression_suites(recipe: RLRecipe) -> list[Suite]:
    """Every domain's held-out items (a suite named by the domain), then the guard's general suites."""
    suites = []
    for index, spec in enumerate(recipe.domains):
        if spec.heldout:
            tasks = sample_tasks(get_domain(spec.name, **spec.args), spec.heldout, level=spec.levels,
                                 split="heldout", seed=recipe.runtime.seed + 1000 + index)
            suites.append(tasks_suite(spec.name, tasks, domain_args=spec.args, seed=recipe.runtime.seed + 1000 + index))
    for index, suite in enumerate(recipe.schedule.guard.suites):
        suites.append(regression_suite(suite, seed=recipe.runtime.seed + 2000 + index))
    return suites


def suite_evaluator(recipe: RLRecipe, suites: list[Suite], model, tokenizer, runtime: Runtime,
                    renderer=None) -> EvaluateFn:
    """Greedy pass@1 of every suite through `posttrain.evaluate`, on an engine of its own (built at the first
    evaluation: the rollout engine may be a version behind); infrastructure failures retried as in rollouts;
    image prompts through `renderer` (a vision-language policy's)."""
    sampling = EvalSampling(max_new_tokens=recipe.rollout.sampling.max_new_tokens, greedy=True)
    eval_runtime = EvalRuntime(batch_size=recipe.rollout.engine_batch_size, infra_retries=recipe.rollout.infra_retries)
    return SuiteEvaluator(suites, tokenizer, lambda: make_engine(model, tokenizer, runtime, recipe),
                          sampling=sampling, runtime=eval_runtime, device=runtime.device.type, renderer=renderer)


EVAL_PREFIXES = ("heldout/", "regression/", "eval/")  # the keys `eval_metrics_of` logs: an evaluation's figures


def eval_metrics_of(recipe: RLRecipe, scores: dict[str, SuiteScore]) -> dict[str, float]:
    """``heldout/<domain>`` and ``heldout/mean`` for the domains' suites, ``regression/<name>`` for the general
    ones (pass rates over scored episodes; a suite with none scored has none), ``eval/infra_failures[/<suite>]``."""
    domains = {spec.name for spec in recipe.domains}
    rates = {name: score.pass_rate for name, score in scores.items() if score.pass_rate is not None}
    heldout = {name: value for name, value in rates.items() if name in domains}
    metrics = {f"heldout/{name}": value for name, value in heldout.items()}
    if heldout:
        metrics["heldout/mean"] = sum(heldout.values()) / len(heldout)
    metrics.update({f"regression/{name}": value for name, value in rates.items() if name not in domains})
    metrics.update({f"eval/infra_failures/{name}": float(score.infra_failures) for name, score in scores.items()})
    if scores:
        metrics["eval/infra_failures"] = float(sum(score.infra_failures for score in scores.values()))
    return metrics


class RunGuard:
    def __init__(self, recipe: RLRecipe, suites: Sequence[Suite]):
        self.recipe = recipe
        self.config = recipe.schedule
        mixed = {spec.name for spec in recipe.domains}
        names = {suite.name for suite in suites}
        suite_domains = {name: name for name in names if name in mixed}
        suite_domains.update({s.name: s.domain if s.domain in mixed else None for s in self.config.guard.suites
                              if s.name in names})
        self.forgetting = ForgettingGuard(self.config.guard, suite_domains)
        self.monitor = CollapseMonitor(self.config.alarms)
        self.has_suites = bool(suites)
        self.rollbacks = 0
        self.lr_scale = 1.0
        self.good_steps: list[int] = []
        self.events: list[dict[str, Any]] = []
        specs = {spec.name: (spec.name, spec.args, spec.levels) for spec in recipe.domains}
        # A suite read from a file (no domain) has no demonstrations to replay.
        specs.update({s.name: (s.domain, s.args, s.levels) for s in self.config.guard.suites if s.domain})
        self._replay_specs = specs
        self._replay_sources: dict[str, tuple[Any, list[int]]] = {}

    # ---- evaluations ------------------------------------------------------------------------------------

    def evaluates_at(self, step: int) -> bool:
        every = self.recipe.train.eval_every
        guard_every = self.config.guard.every if self.config.guard.enabled else None
        return bool(self.has_suites and any(n and step % n == 0 for n in (every, guard_every)))

    def wants_baseline(self) -> bool:
        guard = self.config.guard
        every = guard.every or self.recipe.train.eval_every
        return bool(self.has_suites and guard.enabled and guard.baseline and every)

    def after_eval(self, step: int, scores: dict[str, SuiteScore]) -> list[dict[str, Any]]:
        """Fold an evaluation in: the suites' pass rates (infrastructure failures left out; a suite with nothing
        scored is not read) -> regressions, recoveries and the reward-hacking alarm."""
        rates = {name: score.pass_rate for name, score in scores.items() if score.pass_rate is not None}
        events = self.forgetting.update(step, rates) if self.config.guard.enabled else []
        domains = [rates[spec.name] for spec in self.recipe.domains if spec.name in rates]
        if domains:
            events += self.monitor.observe_eval(step, sum(domains) / len(domains))
        return self._record(events)

    # ---- every step ---------------------------------------------------------------------------------------

    def after_step(self, step: int, metrics: dict[str, float]) -> list[dict[str, Any]]:
        return self._record(self.monitor.observe_step(step, metrics))

    def replay_batch(self, step: int) -> list[SFTSample]:
        suites = [suite for suite in self.forgetting.replay_suites() if suite in self._replay_specs]
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
