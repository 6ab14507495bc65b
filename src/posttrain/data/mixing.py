"""Mixing by weights over metadata: each epoch draws its samples so that groups get their target shares.

A group is named by the values of the `MixConfig.by` keys joined with '/' (``arithmetic/3`` for
``by: [domain, difficulty]``; a missing value reads ``none``). Group g with weight w_g gets

    target_share_g = w_g / sum(w)         count_g = round(target_share_g * total)   (largest remainder)

where unnamed groups weigh `default_weight` (0 drops them) and `total` is `samples_per_epoch`, or, when unset,
the number of samples in the groups that are kept. A group with fewer samples than its count is repeated
(every sample ``count // available`` times, plus a random subset for the remainder); a larger one is
subsampled without replacement. The draw depends only on (seed, epoch, group name), so an epoch can be
re-drawn exactly on resume, and the epoch's order is shuffled by (seed, epoch).

The report lists, per group, the samples available, the target share and the realized share, so the
caller can log them side by side (`mixture_table`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, TypeVar

import numpy as np

from posttrain.config import MixConfig
from posttrain.data.schema import DataError, SampleMetadata

ALL = "all"  # the one group when `by` is empty


class HasMetadata(Protocol):
    metadata: SampleMetadata


T = TypeVar("T", bound=HasMetadata)


@dataclass
class GroupShare:
    available: int
    weight: float
    target_share: float
    count: int  # samples drawn this epoch
    realized_share: float

    @property
    def repeats(self) -> float:
        """How many times each sample is seen on average (above 1: upsampled)."""
        return self.count / self.available if self.available else 0.0


@dataclass
class MixResult:
    samples: list[Any]
    groups: dict[str, GroupShare] = field(default_factory=dict)
    by: list[str] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        """JSON-ready: ``{"by": [...], "total": n, "groups": {name: {available, weight, target_share, ...}}}``."""
        return {
            "by": list(self.by),
            "total": len(self.samples),
            "groups": {
                name: {
                    "available": g.available,
                    "weight": g.weight,
                    "target_share": round(g.target_share, 6),
                    "realized_share": round(g.realized_share, 6),
                    "count": g.count,
                    "repeats": round(g.repeats, 4),
                }
                for name, g in self.groups.items()
            },
        }


def group_name(metadata: SampleMetadata, by: Sequence[str]) -> str:
    if not by:
        return ALL
    return "/".join(_value_name(metadata.get(key)) for key in by)


def _value_name(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def mix(items: Sequence[T], config: MixConfig, *, seed: int, epoch: int) -> MixResult:
    """Draw one epoch's items (anything with a `.metadata`) according to `config`; see the module docstring."""
    if not items:
        return MixResult(samples=[], by=list(config.by))
    groups = _group(items, config.by)
    weights = _weights(groups, config)
    kept = {name: w for name, w in weights.items() if w > 0}
    if not kept:
        raise DataError(f"data.mix: every group has weight 0 (groups: {', '.join(sorted(groups))})")
    total = config.samples_per_epoch
    if total is None:
        total = sum(len(groups[name]) for name in kept)
    counts = _apportion(kept, total)
    chosen: list[int] = []
    shares: dict[str, GroupShare] = {}
    weight_sum = sum(kept.values())
    for name in sorted(groups):
        weight = weights[name]
        count = counts.get(name, 0)
        members = groups[name]
        if count:
            chosen.extend(_draw(members, count, _rng(seed, epoch, name)))
        shares[name] = GroupShare(
            available=len(members),
            weight=weight,
            target_share=weight / weight_sum,
            count=count,
            realized_share=count / total if total else 0.0,
        )
    order = _rng(seed, epoch, "order").permutation(len(chosen))
    return MixResult(samples=[items[chosen[i]] for i in order], groups=shares, by=list(config.by))


def mixture_table(report: dict[str, Any]) -> str:
    """The mixture as aligned text lines: group, available, target share, realized share, repeats."""
    lines = [f"{'group':<24} {'available':>9} {'target':>8} {'realized':>9} {'repeats':>8}"]
    for name, g in report["groups"].items():
        lines.append(
            f"{name:<24} {g['available']:>9} {g['target_share']:>8.1%} {g['realized_share']:>9.1%} "
            f"{g['repeats']:>8.2f}"
        )
    return "\n".join(lines)


def _group(items: Sequence[HasMetadata], by: Sequence[str]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for index, item in enumerate(items):
        groups.setdefault(group_name(item.metadata, by), []).append(index)
    return groups


def _weights(groups: dict[str, list[int]], config: MixConfig) -> dict[str, float]:
    unknown = sorted(set(config.weights) - set(groups))
    if unknown:
        present = ", ".join(sorted(groups)) or "none"
        raise DataError(
            f"data.mix.weights: no samples in group {unknown[0]!r} (groups by {'/'.join(config.by) or '-'}: {present})"
        )
    return {name: float(config.weights.get(name, config.default_weight)) for name in groups}


def _apportion(weights: dict[str, float], total: int) -> dict[str, int]:
    """Integer counts proportional to `weights` that sum to `total` (largest remainder, ties by name)."""
    weight_sum = sum(weights.values())
    exact = {name: total * w / weight_sum for name, w in weights.items()}
    counts = {name: int(value) for name, value in exact.items()}
    left = total - sum(counts.values())
    by_remainder = sorted(exact, key=lambda name: (-(exact[name] - counts[name]), name))
    for name in by_remainder[:left]:
        counts[name] += 1
    return counts


def _draw(members: list[int], count: int, rng: np.random.Generator) -> list[int]:
    full, rest = divmod(count, len(members))
    drawn = [members[i] for _ in range(full) for i in rng.permutation(len(members))]
    drawn.extend(members[i] for i in rng.choice(len(members), size=rest, replace=False))
    return drawn


def _rng(seed: int, epoch: int, name: str) -> np.random.Generator:
    # A stable integer from the group name (Python's hash() is salted per process).
    name_key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.default_rng([seed % (1 << 64), epoch % (1 << 64), name_key])
