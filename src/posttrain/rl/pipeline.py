"""Rollouts ahead of training, with a bounded and *deterministic* staleness.

The trainer takes step k on batch k. With `max_staleness = s`, batch k is sampled with the weights of policy
version max(k - s, first) — exactly that version, not "whatever is newest": the trainer publishes a snapshot
of its weights after every step (`publish_weights`), and the producer swaps them into the engine only between
batches, waiting for the version it needs. So:

* s = 0 is the synchronous on-policy loop (batch k waits for the weights of step k - 1);
* s >= 1 lets the producer sample batch k while the trainer trains on batch k - 1 (generation and training
  overlap; on one machine each side gets its share of the CPU threads);
* for any s, the overlapped run and the inline run (`overlap=False`) compute the same batches from the same
  weights, bit for bit, because nothing depends on timing: sampling seeds derive from (seed, k), the task
  sampler is advanced only by the producer, batch by batch, and weight versions are fixed per batch.

`checkpoint_state()` holds the producer between batches and returns what it has produced and not yet handed
over, with the sampler's state at that moment; a checkpoint stores both, so a resumed run continues the same
stream.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from posttrain.types import Trajectory


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
