"""Connecting to Ray and placing a run's actors: the resource check before anything starts, one placement group.

`ray_session(cluster)` joins the cluster at ``cluster.address`` (or starts a private instance on this machine
when it is unset) unless Ray is already initialized, and shuts down only what it started.

`place(cluster, roles)` checks, before any actor exists, that the cluster has the CPUs and GPUs the requested
actors reserve (counts x per-actor resources, summed) and raises `PlacementError` naming the numbers if not;
then it reserves one bundle per actor in a placement group (so a restarted actor gets its bundle back), and
fails with the same kind of message if Ray cannot place the bundles within ``placement_timeout_s`` (e.g. no
single node has an actor's GPUs).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator

from posttrain.config import ActorResources, ClusterConfig
from posttrain.distributed.errors import DistributedError, PlacementError


@dataclass(frozen=True)
class Role:
    """`count` actors of one kind, each reserving `resources`."""

    name: str  # "rollout workers", "trainer ranks", "sandbox workers"
    count: int
    resources: ActorResources


def import_ray():
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is in the cluster extra
        raise DistributedError("cluster.backend: ray needs Ray: pip install 'posttrain[cluster]'") from None
    return ray


@contextlib.contextmanager
def ray_session(cluster: ClusterConfig) -> Iterator[Any]:
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    options: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    if cluster.address:
        options["address"] = cluster.address
    else:
        options["num_cpus"] = cluster.local_cpus or os.cpu_count() or 1
    try:
        ray.init(**options)
    except (ConnectionError, RuntimeError) as error:
        where = cluster.address or "a private instance on this machine"
        raise DistributedError(f"cluster.address: could not start or join Ray at {where}: {error}") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def check_resources(roles: list[Role], available: dict[str, float], where: str) -> None:
    """Raise `PlacementError` if the roles' summed CPUs or GPUs exceed what the cluster has."""
    problems = []
    for resource, key in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
        wanted = sum(role.count * getattr(role.resources, key) for role in roles)
        have = float(available.get(resource, 0.0))
        if wanted > have + 1e-9:
            parts = " + ".join(f"{role.count} {role.name} x {getattr(role.resources, key):g}" for role in roles
                               if getattr(role.resources, key))
            problems.append(f"{parts} = {wanted:g} {resource}s, but {where} has {have:g}")
    if problems:
        raise PlacementError(
            "cluster: not enough resources for the requested actors: " + "; ".join(problems) + ". Lower "
            "cluster.<role>.num_cpus / num_gpus (fractions are allowed for actors that take turns) or the worker "
            "counts, or add nodes (`ray start --address <head>:6379` on each)."
        )


class Placement:
    """One placement-group bundle per actor, by role; `options(role, index)` schedules an actor into its bundle."""

    def __init__(self, cluster: ClusterConfig, roles: list[Role]):
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group

        where = f"the Ray cluster at {cluster.address}" if cluster.address else "this machine's Ray instance"
        check_resources(roles, ray.cluster_resources(), where)
        self._remove = remove_placement_group
        self._start: dict[str, int] = {}
        bundles = []
        for role in roles:
            self._start[role.name] = len(bundles)
            for _ in range(role.count):
                bundle = {"CPU": role.resources.num_cpus, "GPU": role.resources.num_gpus}
                bundles.append({k: v for k, v in bundle.items() if v} or {"CPU": 0.001})
        self.group = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=cluster.placement_timeout_s)
        if not ready:
            self.close()
            raise PlacementError(
                f"cluster: Ray could not place the actors ({', '.join(f'{r.count} {r.name}' for r in roles)}) "
                f"within {cluster.placement_timeout_s:g} s: the totals fit, but no node has room for some actor's "
                f"CPUs/GPUs (bundles {bundles}; nodes: {_nodes(ray)})"
            )

    def options(self, role: str, index: int, resources: ActorResources) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                    placement_group_bundle_index=self._start[role] + index)
        return {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus, "scheduling_strategy": strategy}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._remove(self.group)


def _nodes(ray) -> str:
    return "; ".join(f"{node.get('NodeManagerAddress')}: {node.get('Resources', {}).get('CPU', 0):g} CPU, "
                     f"{node.get('Resources', {}).get('GPU', 0):g} GPU" for node in ray.nodes() if node.get("Alive"))


def worker_setup(threads: int, imports: list[str]) -> None:
    """What every posttrain actor does first: its torch thread budget, and the user's registrations (modules or
    .py files: `posttrain.usercode`; `cluster.worker_imports` and the recipe's `imports:`)."""
    import torch

    from posttrain.usercode import import_all

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(threads)
    import_all(imports)
