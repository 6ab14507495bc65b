"""What the episode loop samples from: anything with ``async generate(request, sampling) -> list[Completion]``.

`posttrain.rollout.AsyncBatcher` is such an object (a time window, batch caps, per-request seeds, statistics).
`as_policy` also accepts a plain synchronous `InferenceEngine` and wraps it in `SyncEnginePolicy`, a minimal
batcher: the requests the concurrent episodes submit while the event loop goes round once (and while the engine
is busy) go to the engine as one ``generate`` call, run in a worker thread so the loop, timeouts included, keeps
running. Requests batch together when their `SamplingParams` are equal, or equal but for the seed when the
engine takes per-request seeds (``generate(..., request_seeds=[...])``). A failing batch is retried request by
request, so one bad request fails alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Hashable, Protocol, runtime_checkable

from posttrain.types import Completion, GenerationRequest, InferenceEngine, SamplingParams

_GATHER_TICKS = 3  # loop turns to wait for the other episodes' requests before calling the engine


@runtime_checkable
class AsyncPolicy(Protocol):
    async def generate(self, request: GenerationRequest, sampling: SamplingParams) -> list[Completion]: ...


class SyncEnginePolicy:
    """Adapts a synchronous `InferenceEngine` (``generate(requests, sampling) -> list[list[Completion]]``)."""

    def __init__(self, engine: InferenceEngine, max_batch_size: int | None = None):
        self.engine = engine
        self.max_batch_size = max_batch_size or int(getattr(engine, "max_batch_size", 64) or 64)
        self._seeded = "request_seeds" in inspect.signature(engine.generate).parameters
        self._pending: list[tuple[GenerationRequest, SamplingParams, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        # One engine call at a time (an engine is not assumed thread-safe); a call outlives a cancelled caller.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-envs-engine")

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def generate(self, request: GenerationRequest, sampling: SamplingParams) -> list[Completion]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((request, sampling, future))
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            for _ in range(_GATHER_TICKS):
                await asyncio.sleep(0)
            pending, self._pending = [p for p in self._pending if not p[2].done()], []
            groups: dict[Hashable, list[tuple[GenerationRequest, SamplingParams, asyncio.Future]]] = {}
            for item in pending:
                groups.setdefault(self._key(item[1]), []).append(item)
            for group in groups.values():
                capacity = max(1, self.max_batch_size // max(1, group[0][1].n))
                for start in range(0, len(group), capacity):
                    await self._run(group[start:start + capacity])

    async def _run(self, batch: list[tuple[GenerationRequest, SamplingParams, asyncio.Future]]) -> None:
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._executor, self._call, batch)
        except Exception as error:  # handed to the episodes that own the requests
            if len(batch) == 1:
                if not batch[0][2].done():
                    batch[0][2].set_exception(error)
                return
            for item in batch:
                await self._run([item])
            return
        for (_, _, future), completions in zip(batch, results):
            if not future.done():
                future.set_result(list(completions))

    def _call(self, batch: list[tuple[GenerationRequest, SamplingParams, Any]]) -> list[list[Completion]]:
        requests, sampling = [item[0] for item in batch], batch[0][1]
        if self._seeded:
            seeds = [item[1].seed for item in batch]
            return self.engine.generate(requests, dataclasses.replace(sampling, seed=None), request_seeds=seeds)
        return self.engine.generate(requests, sampling)

    def _key(self, sampling: SamplingParams) -> Hashable:
        return sampling.batch_key(ignore_seed=self._seeded)


def turn_sampling(sampling: SamplingParams, turn: int, max_new_tokens: int) -> SamplingParams:
    """One policy turn's sampling: one completion of at most `max_new_tokens`, and, when seeded, the seed
    ``seed + 100003 x turn``, so an episode's turns differ and a seeded episode repeats (the episode loop's turns and
    a black-box agent's calls alike)."""
    return dataclasses.replace(sampling, n=1, max_new_tokens=max_new_tokens,
                               seed=None if sampling.seed is None else sampling.seed + 100_003 * turn)


def as_policy(policy: Any) -> AsyncPolicy:
    """`policy` itself if its ``generate`` is async, else a `SyncEnginePolicy` around it."""
    generate = getattr(policy, "generate", None)
    if generate is None:
        raise TypeError(f"a policy needs a generate method; got {type(policy).__name__}")
    if inspect.iscoroutinefunction(generate):
        return policy
    return SyncEnginePolicy(policy)
