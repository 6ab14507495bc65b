"""Forgetting guard: regression suites against their best, and what to do about one that falls.

Suites are the held-out items of every domain of the run (earlier stages' domains included: a staged mix that
has moved on still evaluates them) and general suites the recipe names (`schedule.guard.suites`). Every
evaluation, a suite whose pass rate is more than `threshold` below its best so far has *regressed* (an event);
it has *recovered* once back within `recover` of its best (another event; the gap is the hysteresis). While a
suite is regressed, by `action`:

* ``weight``: its domain's mixing share is boosted (`mixing.DomainMixer`; a general suite whose domain is not in
  the mix has no share to boost, so only replay helps it);
* ``replay``: the trainer adds ``replay_coef`` times an SFT loss on fresh demonstrations of the suite's domain
  (train split only, never a held-out item) to every RL step;
* ``both``, or ``log`` (events only).
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from posttrain.config import GuardConfig
from posttrain.data import SFTSample
from posttrain.schedule.sampler import apportion, draw_task
from posttrain.tasks import Domain, TaskError


class ForgettingGuard:
    def __init__(self, config: GuardConfig, suite_domains: dict[str, str | None]):
        self.config = config
        self.suite_domains = dict(suite_domains)  # suite -> the mixed domain it protects (None: not mixed)
        self.best: dict[str, float] = {}
        self.best_step: dict[str, int] = {}
        self.regressed: list[str] = []
        self.events: list[dict[str, Any]] = []

    def update(self, step: int, results: dict[str, float]) -> list[dict[str, Any]]:
        """Fold one evaluation (suite -> pass rate) in; returns the new events."""
        new: list[dict[str, Any]] = []
        for suite, value in results.items():
            if suite not in self.suite_domains:
                continue
            if suite not in self.best or value > self.best[suite]:
                self.best[suite], self.best_step[suite] = value, step
            best = self.best[suite]
            if suite not in self.regressed and value < best - self.config.threshold:
                self.regressed.append(suite)
                new.append(self._event("regression", step, suite, value))
            elif suite in self.regressed and value >= best - self.config.recover:
                self.regressed.remove(suite)
                new.append(self._event("recovered", step, suite, value))
        self.events += new
        return new

    def boosted_domains(self) -> list[str]:
        if not self.config.enabled or self.config.action not in ("weight", "both"):
            return []
        return sorted({self.suite_domains[s] for s in self.regressed if self.suite_domains[s] is not None})

    def replay_suites(self) -> list[str]:
        if not self.config.enabled or self.config.action not in ("replay", "both") or self.config.replay_coef == 0:
            return []
        return list(self.regressed)

    def _event(self, kind: str, step: int, suite: str, value: float) -> dict[str, Any]:
        domain = self.suite_domains[suite]
        actions = []
        if kind == "regression":
            if domain is not None and self.config.action in ("weight", "both"):
                actions.append(f"boost {domain}")
            if self.config.action in ("replay", "both") and self.config.replay_coef > 0:
                actions.append("replay SFT")
        return {"kind": kind, "step": step, "suite": suite, "value": value, "best": self.best[suite],
                "best_step": self.best_step[suite], "domain": domain, "actions": actions or ["log"]}

    def state_dict(self) -> dict[str, Any]:
        return {"best": dict(self.best), "best_step": dict(self.best_step), "regressed": list(self.regressed),
                "events": [dict(e) for e in self.events]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step = dict(state["best"]), dict(state["best_step"])
        self.regressed, self.events = list(state["regressed"]), [dict(e) for e in state["events"]]


def replay_samples(sources: Sequence[tuple[Domain, Sequence[int]]], count: int, rng: random.Random
                   ) -> list[SFTSample]:
    """`count` demonstrations of fresh train-split tasks, shared evenly by `sources` (domain, levels). A domain
    that cannot demonstrate (some reasoning-gym generators) contributes none."""
    if not sources:
        return []
    shares = apportion({str(i): 1.0 for i in range(len(sources))}, count, rng)
    samples: list[SFTSample] = []
    for i, (source, levels) in enumerate(sources):
        for _ in range(shares[str(i)]):
            task = draw_task(source, rng.choice(list(levels)), rng)
            try:
                samples.append(source.demonstration(task))
            except (TaskError, NotImplementedError):
                break
    return samples
