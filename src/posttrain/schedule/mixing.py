"""Domain mixing: the share of trained groups each domain should get, and how many to sample to get it.

Target shares (`target`), by `mixing.mode`:

* ``static``: the recipe's domain weights;
* ``staged``: the weights of the stage whose `until_step` is the first beyond the batch index (domains a stage
  leaves out get 0);
* ``adaptive``: a multiplicative-weights bandit on the recipe weights,
  ``w_d ∝ weight_d * exp(adapt_rate * (score_d - mean score))``, where ``score_d`` is the moving share of the
  domain's groups with reward spread (``learning_signal``: train where there is something to learn) or its
  moving failure rate (``worst_domain``); every domain then keeps at least `min_share`.

The forgetting guard may boost regressed domains: their share becomes ``max(boost * share, boost_min_share)``
and the others shrink to make room (a domain a stage has set to 0 can so come back).

Compensation (`sampling_weights`): dynamic sampling drops groups without signal and infrastructure failures lose
groups, unevenly across domains. Sampling each domain in proportion to ``target / keep_rate`` (its moving share of
groups that reach the trainer, at least `min_keep_rate`) makes the *trained* shares, not the sampled ones,
match the target; the refills of a batch go to the domains still short of their count.
"""

from __future__ import annotations

import math
from typing import Any

from posttrain.config import GuardConfig, MixingConfig


class DomainMixer:
    def __init__(self, weights: dict[str, float], config: MixingConfig, guard: GuardConfig):
        self.weights = dict(weights)  # the recipe's per-domain weights
        self.config, self.guard = config, guard
        self.keep_rate: dict[str, float | None] = {name: None for name in weights}  # share reaching the trainer
        self.signal: dict[str, float | None] = {name: None for name in weights}  # share of groups with spread
        self.pass_rate: dict[str, float | None] = {name: None for name in weights}
        self.boosted: list[str] = []  # regressed domains (the forgetting guard)

    def target(self, index: int) -> dict[str, float]:
        """Target shares of the trained groups of batch `index` (summing to 1)."""
        if self.config.mode == "staged":
            stage = next((s for s in self.config.stages if s.until_step is None or index < s.until_step),
                         self.config.stages[-1])
            weights = {name: stage.weights.get(name, 0.0) for name in self.weights}
        elif self.config.mode == "adaptive":
            weights = self._adaptive()
        else:
            weights = dict(self.weights)
        shares = _normalized(weights)
        return self._boost(shares) if self.boosted else shares

    def sampling_weights(self, targets: dict[str, float]) -> dict[str, float]:
        if not self.config.compensate_filtering:
            return dict(targets)
        return {name: share / max(1.0 if self.keep_rate[name] is None else self.keep_rate[name],
                                  self.config.min_keep_rate)
                for name, share in targets.items()}

    def observe_batch(self, groups: dict[str, int], kept: dict[str, int], signal: dict[str, int],
                      episodes: dict[str, int], passes: dict[str, int]) -> None:
        """Fold one finished batch's counts per domain (scored groups, kept, with spread) into the averages."""
        decay = self.config.signal_ema
        for name in self.weights:
            if groups.get(name):
                self.keep_rate[name] = _ema(self.keep_rate[name], kept.get(name, 0) / groups[name], decay)
                self.signal[name] = _ema(self.signal[name], signal.get(name, 0) / groups[name], decay)
            if episodes.get(name):
                self.pass_rate[name] = _ema(self.pass_rate[name], passes.get(name, 0) / episodes[name], decay)

    def _adaptive(self) -> dict[str, float]:
        active = [name for name, weight in self.weights.items() if weight > 0]
        if self.config.objective == "learning_signal":
            scores = {name: self.signal[name] for name in active}
        else:
            scores = {name: None if self.pass_rate[name] is None else 1.0 - self.pass_rate[name] for name in active}
        known = [v for v in scores.values() if v is not None]
        fill = sum(known) / len(known) if known else 0.0
        values = {name: fill if v is None else v for name, v in scores.items()}
        mean = sum(values.values()) / len(values)
        raw = _normalized({name: self.weights[name] * math.exp(self.config.adapt_rate * (values[name] - mean))
                           for name in active})
        floor = self.config.min_share
        shares = {name: floor + (1 - floor * len(active)) * share for name, share in raw.items()}
        return {name: shares.get(name, 0.0) for name in self.weights}

    def _boost(self, shares: dict[str, float]) -> dict[str, float]:
        boosted = {name: min(1.0, max(self.guard.boost * shares[name], self.guard.boost_min_share))
                   for name in self.boosted if name in shares}
        rest = {name: share for name, share in shares.items() if name not in boosted}
        room, rest_mass = 1.0 - sum(boosted.values()), sum(rest.values())
        if room <= 0 or rest_mass <= 0:
            return _normalized({**rest, **boosted})
        return {name: boosted[name] if name in boosted else shares[name] * room / rest_mass for name in shares}

    def state_dict(self) -> dict[str, Any]:
        return {"keep_rate": dict(self.keep_rate), "signal": dict(self.signal), "pass_rate": dict(self.pass_rate),
                "boosted": list(self.boosted)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.keep_rate, self.signal = dict(state["keep_rate"]), dict(state["signal"])
        self.pass_rate, self.boosted = dict(state["pass_rate"]), list(state["boosted"])


def _normalized(weights: dict[str, float]) -> dict[str, float]:
    mass = sum(weights.values())
    if mass <= 0:
        raise ValueError(f"domain weights must not all be 0: {weights}")
    return {name: weight / mass for name, weight in weights.items()}


def _ema(old: float | None, new: float, decay: float) -> float:
    return new if old is None else decay * old + (1 - decay) * new
