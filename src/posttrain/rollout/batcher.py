"""`AsyncBatcher`: many concurrent episodes, one engine, few big batches.

Each episode coroutine awaits ``batcher.generate(request, sampling)`` for its own request. The batcher holds
requests for a short window (``max_wait_s`` from the first one waiting) or until ``max_batch_size`` sequences
are waiting, then runs them as one ``engine.generate`` call in a worker thread, so the event loop keeps
serving episodes (tool calls, sandboxes) meanwhile. While the engine runs, new requests queue up and go in
the next batch as soon as it finishes — under load, batches fill by themselves.

Callers that announce themselves (``with batcher.client(): ...`` around an episode; `posttrain.envs.rollout_many`
does) let the batcher skip the window: once every announced caller is waiting on it, nobody is left to add a
request, and the batch runs at once. A caller busy elsewhere (a tool call in a sandbox) keeps the window open.

``inline=True`` runs the engine on the event loop's own thread instead (the loop waits while it samples; a
sandbox already running keeps running in its own process). That is for a caller with nothing to do meanwhile
— a synchronous RL step — on a CPU, where torch's OpenMP threads are fastest on the thread that already owns
them: measured on 2 cores, 64 x 32 tokens of tiny-3m took 0.08 s sampled on the main thread and 0.19 s from a
worker thread (0.12 s on one thread there).

Only requests with compatible sampling go in one batch: equal `SamplingParams` except the seed. A seeded
request keeps its own random stream (the engine's ``request_seeds``), so it samples the same tokens whatever
it was batched with. If a batch fails, its requests are retried one by one, so one bad request fails alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from collections.abc import Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

from posttrain.types import Completion, GenerationRequest, InferenceEngine, SamplingParams


@dataclass
class _Waiting:
    request: GenerationRequest
    sampling: SamplingParams
    future: asyncio.Future
    arrived: float


@dataclass
class BatcherStats:
    engine_calls: int = 0
    requests: int = 0
    sequences: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # requests per engine call, most recent last

    def record(self, size: int, n: int) -> None:
        self.engine_calls += 1
        self.requests += size
        self.sequences += size * n
        self.batch_sizes = (self.batch_sizes + [size])[-1000:]


class AsyncBatcher:
    """Batches concurrent ``generate`` calls for one engine; see the module docstring."""

    def __init__(self, engine: InferenceEngine, *, max_batch_size: int | None = None, max_wait_s: float = 0.005,
                 inline: bool = False):
        self.engine = engine
        self.inline = inline
        self.max_batch_size = max_batch_size or getattr(engine, "max_batch_size", 64)
        self.max_wait_s = max_wait_s
        self.stats = BatcherStats()
        parameters = inspect.signature(engine.generate).parameters
        self._per_request_seeds = "request_seeds" in parameters
        self._groups: dict[Hashable, list[_Waiting]] = {}
        self._arrival = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self._clients = 0  # announced callers (`client()`); 0: none announced, the window always applies
        self._executor = None if inline else ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-rollout")

    async def generate(self, request: GenerationRequest, sampling: SamplingParams) -> list[Completion]:
        """The ``sampling.n`` completions of `request`, sampled in a batch with other callers' requests."""
        loop = asyncio.get_running_loop()
        waiting = _Waiting(request, sampling, loop.create_future(), time.monotonic())
        self._groups.setdefault(self._key(sampling), []).append(waiting)
        self._arrival.set()
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._drain())
        return await waiting.future

    @contextmanager
    def client(self) -> Iterator[None]:
        """Announce a caller for its duration: when all announced callers wait, a batch runs without the window."""
        self._clients += 1
        try:
            yield
        finally:
            self._clients -= 1
            self._arrival.set()  # the callers left may all be waiting now

    async def aclose(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def __aenter__(self) -> AsyncBatcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- internals ----------------------------------------------------------------------------------

    def _key(self, sampling: SamplingParams) -> Hashable:
        return sampling.batch_key(ignore_seed=self._per_request_seeds)

    def _capacity(self, sampling: SamplingParams) -> int:
        return max(1, self.max_batch_size // sampling.n)

    def _next_group(self) -> tuple[Hashable, float] | None:
        """The group to run next (a full one, else the one waiting longest) and how long to wait for it."""
        for waiting in self._groups.values():
            waiting[:] = [w for w in waiting if not w.future.done()]  # drop cancelled callers
        self._groups = {k: v for k, v in self._groups.items() if v}
        if not self._groups:
            return None
        now = time.monotonic()
        for key, waiting in self._groups.items():
            if len(waiting) >= self._capacity(waiting[0].sampling):
                return key, 0.0
        key = min(self._groups, key=lambda k: self._groups[k][0].arrived)
        if self._clients and sum(map(len, self._groups.values())) >= self._clients:
            return key, 0.0  # every announced caller waits here: no request is coming to fill the batch
        return key, max(0.0, self._groups[key][0].arrived + self.max_wait_s - now)

    async def _drain(self) -> None:
        while True:
            chosen = self._next_group()
            if chosen is None:
                return
            key, delay = chosen
            if delay > 0:
                self._arrival.clear()
                try:
                    await asyncio.wait_for(self._arrival.wait(), timeout=delay)
                except asyncio.TimeoutError:
                    pass
                continue
            waiting = self._groups[key]
            batch = waiting[: self._capacity(waiting[0].sampling)]
            del waiting[: len(batch)]
            await self._run(batch)

    async def _run(self, batch: list[_Waiting]) -> None:
        loop = asyncio.get_running_loop()
        try:
            if self._executor is None:
                results = self._call(batch)
            else:
                results = await loop.run_in_executor(self._executor, self._call, batch)
            if len(results) != len(batch):  # a request left without an answer would wait out ENGINE_WAIT_S
                raise RuntimeError(f"the engine answered {len(results)} of {len(batch)} requests")
        except Exception as error:  # noqa: BLE001 - handed to the caller(s) that own the request(s)
            if len(batch) == 1:
                if not batch[0].future.done():
                    batch[0].future.set_exception(error)
                return
            for waiting in batch:  # isolate the request(s) that made the batch fail
                await self._run([waiting])
            return
        for waiting, completions in zip(batch, results):
            if not waiting.future.done():
                waiting.future.set_result(completions)

    def _call(self, batch: list[_Waiting]) -> list[list[Completion]]:
        sampling = batch[0].sampling
        requests = [w.request for w in batch]
        self.stats.record(len(batch), sampling.n)
        if self._per_request_seeds:
            seeds = [w.sampling.seed for w in batch]
            return self.engine.generate(requests, dataclasses.replace(sampling, seed=None), request_seeds=seeds)
        return self.engine.generate(requests, sampling)
