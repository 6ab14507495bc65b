"""Collapse alarms: signs in the training signals that a run is going wrong.

Watched every step (exponential moving averages with weight `ema` on the old value):

* ``spread_collapse``: the share of groups with reward spread (``dynamic/signal_share``) falls below
  `spread_min_ratio` times its peak: the policy has become deterministic, or the tasks all-pass / all-fail;
* ``entropy_collapse``: the policy's token entropy (``train/entropy``) falls below `entropy_min_ratio` times
  its peak;
* ``grad_norm_spike`` / ``loss_spike``: ``train/grad_norm`` / ``train/loss`` beyond mean + `spike_z` standard
  deviations of its moving statistics (a spike does not enter the statistics it is judged by); a signal whose
  statistics have no spread yet (constant so far) is not judged.

And at every held-out evaluation:

* ``reward_hacking``: the moving train reward rose by `hacking_reward_rise` since the previous evaluation
  while the held-out mean fell by `hacking_heldout_drop`: the policy is learning the reward, not the task.

No alarm fires before `warmup_steps`. An alarm of a falling kind fires once, and re-arms when its signal is back
above the midpoint between the threshold and the peak. What a run does on an alarm (log, or roll back and
lower the learning rate) is the trainer's business.
"""

from __future__ import annotations

import math
from typing import Any

from posttrain.config import AlarmConfig

_FALLING = {"spread_collapse": ("dynamic/signal_share", "spread_min_ratio"),
            "entropy_collapse": ("train/entropy", "entropy_min_ratio")}
_SPIKES = {"grad_norm_spike": "train/grad_norm", "loss_spike": "train/loss"}
ALARM_KINDS = (*_FALLING, *_SPIKES, "reward_hacking")


class CollapseMonitor:
    def __init__(self, config: AlarmConfig):
        self.config = config
        self.average: dict[str, float] = {}  # moving average per watched metric
        self.variance: dict[str, float] = {}  # moving variance (spikes)
        self.peak: dict[str, float] = {}
        self.disarmed: list[str] = []  # falling alarms that fired and wait for recovery
        self.steps = 0
        self.reward_at_eval: float | None = None
        self.heldout_at_eval: float | None = None

    def observe_step(self, step: int, metrics: dict[str, float]) -> list[dict[str, Any]]:
        self.steps += 1
        armed = self.config.enabled and self.steps > self.config.warmup_steps
        alarms = []
        for kind, metric in _SPIKES.items():
            value = metrics.get(metric)
            if value is None or not math.isfinite(value):
                continue
            spike = self._spike(metric, value)
            if spike is not None and armed:
                alarms.append(_alarm(kind, step, metric, value, spike))
        for kind, (metric, ratio_key) in _FALLING.items():
            value = metrics.get(metric)
            if value is None or not math.isfinite(value):
                continue
            average = self._track(metric, value)
            self.peak[metric] = max(self.peak.get(metric, average), average)
            floor = getattr(self.config, ratio_key) * self.peak[metric]
            if kind in self.disarmed:
                if average >= (floor + self.peak[metric]) / 2:
                    self.disarmed.remove(kind)
            elif armed and average < floor:
                self.disarmed.append(kind)
                alarms.append(_alarm(kind, step, metric, average, floor))
        self._track("reward/mean", metrics.get("reward/mean"))
        return alarms

    def observe_eval(self, step: int, heldout_mean: float) -> list[dict[str, Any]]:
        reward = self.average.get("reward/mean")
        alarms = []
        if (self.config.enabled and self.steps > self.config.warmup_steps and reward is not None
                and self.reward_at_eval is not None and self.heldout_at_eval is not None):
            rise, drop = reward - self.reward_at_eval, self.heldout_at_eval - heldout_mean
            if rise >= self.config.hacking_reward_rise and drop >= self.config.hacking_heldout_drop:
                alarms.append({"kind": "reward_hacking", "step": step, "metric": "heldout/mean", "value": heldout_mean,
                               "threshold": self.heldout_at_eval - self.config.hacking_heldout_drop,
                               "reward_rise": rise})
        self.reward_at_eval, self.heldout_at_eval = reward, heldout_mean
        return alarms

    def _track(self, metric: str, value: float | None) -> float:
        if value is None:
            return self.average.get(metric, 0.0)
        old = self.average.get(metric)
        self.average[metric] = value if old is None else self.config.ema * old + (1 - self.config.ema) * value
        return self.average[metric]

    def _spike(self, metric: str, value: float) -> float | None:
        """The threshold `value` broke, or None (and then `value` joins the statistics)."""
        mean, variance = self.average.get(metric), self.variance.get(metric, 0.0)
        # a history without spread (e.g. steps that trained nothing: grad norm and loss exactly 0) gives no scale
        # to judge a spike by: the first step that trains would break a threshold of 0
        if mean is not None and self.steps > 2 and variance > 0.0:
            threshold = mean + self.config.spike_z * math.sqrt(variance)
            if value > threshold:
                return threshold
        if mean is None:
            self.average[metric], self.variance[metric] = value, 0.0
        else:
            decay = self.config.ema
            delta = value - mean
            self.average[metric] = mean + (1 - decay) * delta
            self.variance[metric] = decay * (variance + (1 - decay) * delta * delta)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"average": dict(self.average), "variance": dict(self.variance), "peak": dict(self.peak),
                "disarmed": list(self.disarmed), "steps": self.steps, "reward_at_eval": self.reward_at_eval,
                "heldout_at_eval": self.heldout_at_eval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.average, self.variance, self.peak = dict(state["average"]), dict(state["variance"]), dict(state["peak"])
        self.disarmed, self.steps = list(state["disarmed"]), state["steps"]
        self.reward_at_eval, self.heldout_at_eval = state["reward_at_eval"], state["heldout_at_eval"]


def _alarm(kind: str, step: int, metric: str, value: float, threshold: float) -> dict[str, Any]:
    return {"kind": kind, "step": step, "metric": metric, "value": value, "threshold": threshold}
