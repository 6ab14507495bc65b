"""What the HTTP layer talks to: a `Backend` takes a `StreamRequest` and yields its events on the event loop.

* `HFBackend`: the built-in engine under a `ContinuousBatcher`. Its loop runs on a thread of its own
  (`run`: the CLI gives it the main thread, which owns torch's OpenMP pool); after every decode step one
  ``call_soon_threadsafe`` wakes the requests that got tokens, so the event loop pays one wake-up per step,
  not one per token. A stream whose consumer goes away (client disconnect) cancels its request, which frees
  its rows at the next step.
* `VLLMBackend` (UNTESTED: no GPU or vLLM here): `VLLMEngine.generate` on the waiting requests, grouped by
  sampling settings, in a worker thread; tokens arrive when a whole batch is done (vLLM's own continuous
  batching runs inside one call; it is not exposed step by step through the offline API it is built on).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from posttrain.rollout import ContinuousBatcher, RolloutError, SequenceEvent, StreamRequest, check_room
from posttrain.serve.errors import APIError
from posttrain.types import GenerationRequest

Disconnected = Callable[[], Awaitable[bool]]
_POLL_S = 0.25  # how often a non-streaming request checks whether its client is still there
# The least time between two wake-ups of the HTTP side for new tokens (`_Signals`; ``--stream-interval``). 0:
# every step's tokens are streamed as soon as the loop is free (docs/serve.md has the measured trade-off).
STREAM_INTERVAL_S = 0.0


class Backend(Protocol):
    tokenizer: Any
    max_length: int | None

    @property
    def waiting(self) -> int: ...

    @property
    def running(self) -> int: ...

    def check(self, prompt: list[int], max_new_tokens: int) -> None:
        """Raise APIError(400) when the prompt cannot be served (empty, unknown ids, no room in the context)."""

    def cancel(self, request: StreamRequest) -> None: ...

    def events(self, request: StreamRequest, disconnected: Disconnected | None = None
               ) -> AsyncIterator[list[SequenceEvent]]: ...


class _Signals:
    """Per request an asyncio.Event on the server's loop, set from the engine's thread.

    Wake-ups are coalesced: the loop is woken at most once per `interval_s`; steps in between only add their
    requests to the pending set (no wake-up of the loop, no GIL handoff to the HTTP thread), and the next
    flush sets them all, so a stream's chunk carries every token since its last one. Fewer, larger chunks:
    less SSE work in the server and less parsing in the clients, for at most `interval_s` more latency.
    """

    def __init__(self, interval_s: float = 0.0) -> None:
        self.interval_s = interval_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.events: dict[int, asyncio.Event] = {}
        self._lock = threading.Lock()
        self._pending: set[int] = set()
        self._armed = False  # a flush is scheduled on the loop: later steps need not wake it
        self._last = float("-inf")  # loop time of the last flush

    def open(self, request: StreamRequest) -> asyncio.Event:
        self.loop = asyncio.get_running_loop()
        event = asyncio.Event()
        self.events[id(request)] = event
        return event

    def close(self, request: StreamRequest) -> None:
        self.events.pop(id(request), None)

    def notify(self, requests: list[StreamRequest]) -> None:
        """Called on the engine's thread: at most one wake-up of the loop per interval for all requests."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        with self._lock:
            self._pending.update(id(r) for r in requests)
            if self._armed:
                return
            self._armed = True
        loop.call_soon_threadsafe(self._arm)

    def _arm(self) -> None:
        assert self.loop is not None
        wait = self._last + self.interval_s - self.loop.time()
        if wait > 0:
            self.loop.call_later(wait, self._flush)
        else:
            self._flush()

    def _flush(self) -> None:
        assert self.loop is not None
        with self._lock:
            keys, self._pending, self._armed = self._pending, set(), False
        self._last = self.loop.time()
        for key in keys:
            event = self.events.get(key)
            if event is not None:
                event.set()


async def _follow(request: StreamRequest, signal: asyncio.Event, cancel: Callable[[StreamRequest], None],
                  disconnected: Disconnected | None) -> AsyncIterator[list[SequenceEvent]]:
    finished = False
    try:
        while True:
            if disconnected is None:
                await signal.wait()
            else:
                try:
                    await asyncio.wait_for(signal.wait(), timeout=_POLL_S)
                except asyncio.TimeoutError:
                    if await disconnected():
                        return
                    continue
            signal.clear()
            batch = request.drain()
            if request.error is not None:
                raise APIError(500, str(request.error), type="server_error")
            if batch:
                yield batch
            if request.finished:
                finished = True
                return
    finally:
        if not finished:
            cancel(request)


async def stream_events(signals: _Signals, request: StreamRequest, submit: Callable[[StreamRequest], None],
                        cancel: Callable[[StreamRequest], None], disconnected: Disconnected | None
                        ) -> AsyncIterator[list[SequenceEvent]]:
    """Every backend's `events`: a signal for `request`, `submit` it (a RolloutError is the request's 400), then
    its events as they come (`_follow`: `cancel` when the consumer goes away before the end)."""
    signal = signals.open(request)
    try:
        try:
            submit(request)
        except RolloutError as error:
            raise APIError(400, str(error)) from None
        async for batch in _follow(request, signal, cancel, disconnected):
            yield batch
    finally:
        signals.close(request)


def check_prompt_room(prompt: list[int], max_new_tokens: int, vocab_size: int, max_length: int | None) -> None:
    """Every backend's `check`: `check_room`'s rules, a failure as the request's 400."""
    try:
        check_room(prompt, max_new_tokens, vocab_size, max_length)
    except RolloutError as error:
        raise APIError(400, str(error), param="messages", code="context_length_exceeded"
                       if "context" in str(error) else None) from None


class HFBackend:
    """The built-in engine with continuous batching; see the module docstring."""

    def __init__(self, batcher: ContinuousBatcher, *, stream_interval_s: float = STREAM_INTERVAL_S):
        self.batcher = batcher
        self.tokenizer = batcher.engine.tokenizer
        self.max_length = batcher.engine.max_length
        self.stream_interval_s = stream_interval_s
        self._signals = _Signals(stream_interval_s)
        batcher.on_step = self._signals.notify

    @property
    def waiting(self) -> int:
        return self.batcher.waiting

    @property
    def running(self) -> int:
        return self.batcher.running

    def run(self, stop: threading.Event) -> None:
        self.batcher.run(stop)

    def check(self, prompt: list[int], max_new_tokens: int) -> None:
        engine = self.batcher.engine
        check_prompt_room(prompt, max_new_tokens, engine.vocab_size, engine.max_length)

    def cancel(self, request: StreamRequest) -> None:
        self.batcher.cancel(request)

    def events(self, request: StreamRequest, disconnected: Disconnected | None = None
               ) -> AsyncIterator[list[SequenceEvent]]:
        return stream_events(self._signals, request, self.batcher.submit, self.batcher.cancel, disconnected)


class VLLMBackend:
    """`VLLMEngine` behind the same interface (UNTESTED here; see the module docstring)."""

    def __init__(self, engine: Any, max_length: int | None, vocab_size: int):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_length, self.vocab_size = max_length, vocab_size
        self._signals = _Signals()
        self._queue: list[StreamRequest] = []
        self._running = 0
        self._wake = threading.Condition()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return self._running

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self._wake:
                if not self._queue:
                    self._wake.wait(timeout=0.05)
                batch, self._queue = self._queue, []
            groups: dict[tuple, list[StreamRequest]] = {}
            for request in batch:
                if not request.cancelled:
                    key = request.sampling.batch_key(ignore_seed=True)
                    groups.setdefault(key, []).append(request)
            for group in groups.values():
                self._generate(group)

    def _generate(self, group: list[StreamRequest]) -> None:
        self._running = sum(r.sampling.n for r in group)
        sampling = dataclasses.replace(group[0].sampling, seed=None)
        try:
            results = self.engine.generate([GenerationRequest(r.prompt_token_ids) for r in group], sampling,
                                           request_seeds=[r.sampling.seed for r in group])
        except Exception as error:  # noqa: BLE001 - fail this group, keep serving
            for request in group:
                request.deliver([], error)
            self._signals.notify(group)
            return
        finally:
            self._running = 0
        for request, completions in zip(group, results):
            for index, completion in enumerate(completions):
                events = [SequenceEvent(index, token, logprob)
                          for token, logprob in zip(completion.token_ids, completion.logprobs)]
                if not events:
                    events.append(SequenceEvent(index, -1, 0.0))
                events[-1].completion = completion
                request.deliver(events)
        self._signals.notify(group)

    def cancel(self, request: StreamRequest) -> None:
        request.cancelled = True

    def check(self, prompt: list[int], max_new_tokens: int) -> None:
        check_prompt_room(prompt, max_new_tokens, self.vocab_size, self.max_length)

    def _submit(self, request: StreamRequest) -> None:
        with self._wake:
            self._queue.append(request)
            self._wake.notify()

    def events(self, request: StreamRequest, disconnected: Disconnected | None = None
               ) -> AsyncIterator[list[SequenceEvent]]:
        return stream_events(self._signals, request, self._submit, self.cancel, disconnected)
