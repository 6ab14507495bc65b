"""The HTTP side in a process of its own: the engine loop keeps its process (and its GIL) to itself.

In one process the HTTP thread (JSON, the chat template, SSE encoding, the ASGI stack) takes the GIL from the
engine loop between its decode steps; a profile of 64 streaming clients had the engine thread busy 85% of the
time and the HTTP thread 23%, both wanting the interpreter at once. Here uvicorn runs in a child process
(started with ``spawn``: no fork of a process that already runs torch's thread pools) and talks to the engine
over two pipes:

* HTTP -> engine: lists of ``("submit", key, prompt ids, sampling, top_logprobs, ignore_eos, request id)`` and
  ``("cancel", key)``, one list per turn of the event loop (requests that arrive together reach the batcher
  together: one prefill); `EngineLink` (a thread in the engine's process) submits them to the `ContinuousBatcher`;
* engine -> HTTP: once per decode step, ``("step", waiting, running, [(key, events, error), ...])`` with the
  events every request got in that step (each `SequenceEvent`'s fields as a tuple), sent from the batcher's
  ``on_step`` on the engine loop.

`RemoteBackend` is the `Backend` the app sees in the child: requests are checked there (the same rules as
`ContinuousBatcher.submit`), a reader on the event loop takes the step messages off the pipe, appends the events
to each request and wakes its handler (`_Signals`: at most once per ``stream_interval_s``). A closed pipe on
either side stops the other.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from typing import Any

from posttrain.rollout import ContinuousBatcher, RolloutError, SequenceEvent, StreamRequest, check_request
from posttrain.serve.backends import Disconnected, _Signals, check_prompt_room, stream_events
from posttrain.serve.errors import ServeError

log = logging.getLogger(__name__)


class EngineLink:
    """The engine's end: requests from the pipe into the batcher, each step's events back (see the module doc)."""

    def __init__(self, batcher: ContinuousBatcher, requests: Connection, events: Connection, stop: threading.Event):
        self.batcher, self.requests, self.events, self.stop = batcher, requests, events, stop
        self._live: dict[int, StreamRequest] = {}  # key -> request, for cancels
        self._keys: dict[int, int] = {}  # id(request) -> key, for the steps' events
        self._lock = threading.Lock()  # the two dicts (filled on the link's thread, read on the engine loop's) and the events pipe
        batcher.on_step = self._send
        self._thread = threading.Thread(target=self._receive, name="posttrain-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _receive(self) -> None:
        try:
            while not self.stop.is_set():
                submitted: list[StreamRequest] = []  # a message's submits go to the batcher together
                for message in self.requests.recv():
                    if message[0] == "submit":
                        _, key, prompt, sampling, top_logprobs, ignore_eos, request_id = message
                        request = StreamRequest(prompt, sampling, top_logprobs=top_logprobs,
                                                request_id=request_id, ignore_eos=ignore_eos)
                        with self._lock:
                            self._live[key] = request
                            self._keys[id(request)] = key
                        submitted.append(request)
                    elif message[0] == "cancel":
                        self._submit(submitted)  # a cancel may be for one of them: submitted first
                        submitted = []
                        with self._lock:
                            request = self._live.pop(message[1], None)
                            if request is not None:
                                self._keys.pop(id(request), None)
                        if request is not None:
                            self.batcher.cancel(request)
                self._submit(submitted)
        except (EOFError, OSError):
            pass  # the HTTP process is gone
        self.stop.set()

    def _submit(self, requests: list[StreamRequest]) -> None:
        for request, error in self.batcher.submit_many(requests):  # checked on the HTTP side first: rare
            request.error = error
            self._send([request])

    def _send(self, updated: list[StreamRequest]) -> None:
        """One message with every updated request's events. Called from the engine loop and, for a refused
        submit, from the receiving thread: the lock is held through the send, so the two never write to the
        pipe at once (interleaved writes would corrupt it)."""
        with self._lock:
            batch = []
            for request in updated:
                key = self._keys.get(id(request))
                if key is None:
                    continue
                if request.done:
                    self._live.pop(key, None)
                    self._keys.pop(id(request), None)
                # Events as plain tuples: a step's 64 dataclass events pickle in ~4x the time, on the engine loop.
                events = [(e.index, e.token_id, e.logprob, e.top_logprobs, e.completion) for e in request.drain()]
                batch.append((key, events, None if request.error is None else str(request.error)))
            try:
                self.events.send(("step", self.batcher.waiting, self.batcher.running, batch))
            except (BrokenPipeError, OSError):
                self.stop.set()


class RemoteBackend:
    """The HTTP process's `Backend`: the engine in the parent process, over pipes (see the module docstring)."""

    def __init__(self, requests: Connection, events: Connection, tokenizer: Any, *, max_length: int | None,
                 vocab_size: int, max_batch_size: int, stream_interval_s: float = 0.0):
        self._to_engine, self._from_engine = requests, events
        self.tokenizer, self.max_length = tokenizer, max_length
        self.vocab_size, self.max_batch_size = vocab_size, max_batch_size
        self._signals = _Signals(stream_interval_s)
        self._live: dict[int, StreamRequest] = {}  # key -> request
        self._keys: dict[int, int] = {}  # id(request) -> key
        self._next_key = 0
        self._outbox: list[tuple] = []  # messages for the engine, sent at the end of this turn of the loop
        self._waiting = self._running = 0
        self.engine_gone = asyncio.Event()

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return self._running

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's step messages on `loop` (as they arrive, no thread of its own)."""
        loop.add_reader(self._from_engine.fileno(), self._read)

    def _read(self) -> None:
        try:
            while self._from_engine.poll():
                _, self._waiting, self._running, batch = self._from_engine.recv()
                updated = []
                for key, events, error in batch:
                    request = self._live.get(key)
                    if request is None:
                        continue
                    request.deliver([SequenceEvent(*event) for event in events],
                                    None if error is None else RolloutError(error))
                    updated.append(request)
                    if request.done:
                        self._forget(key)
                self._signals.notify(updated)
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self._from_engine.fileno())
            for request in self._live.values():
                request.error = RolloutError("the engine process is gone")
            self._signals.notify(list(self._live.values()))
            self.engine_gone.set()

    def check(self, prompt: list[int], max_new_tokens: int) -> None:
        check_prompt_room(prompt, max_new_tokens, self.vocab_size, self.max_length)

    def cancel(self, request: StreamRequest) -> None:
        request.cancelled = True
        key = self._keys.get(id(request))
        if key is not None:
            self._forget(key)
            self._send(("cancel", key))

    def _forget(self, key: int) -> None:
        request = self._live.pop(key, None)
        if request is not None:
            self._keys.pop(id(request), None)

    def _send(self, message: tuple) -> None:
        """Queue `message` for the engine; what the handlers queue in one turn of the event loop goes in one pipe
        message at its end (`_flush`). 64 clients' requests that arrive together are handled one after another
        here; sent one by one, the engine would start the first alone and join the rest to it in bursts (one
        prefill each, and a KV copy of the running batch per join); sent together, they are one prefill."""
        self._outbox.append(message)
        if len(self._outbox) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        messages, self._outbox = self._outbox, []
        try:
            self._to_engine.send(messages)
        except (BrokenPipeError, OSError):
            failed = [self._live[m[1]] for m in messages if m[0] == "submit" and m[1] in self._live]
            for request in failed:
                request.deliver([], RolloutError("the engine process is gone"))
            self._signals.notify(failed)

    def _submit(self, request: StreamRequest) -> None:
        """Checked here by the batcher's own rules (`check_request`), then sent to the engine's process."""
        check_request(request.prompt_token_ids, request.sampling, self.vocab_size, self.max_length,
                      self.max_batch_size)
        key, self._next_key = self._next_key, self._next_key + 1
        self._live[key], self._keys[id(request)] = request, key
        self._send(("submit", key, request.prompt_token_ids, request.sampling, request.top_logprobs,
                    request.ignore_eos, request.request_id))

    async def events(self, request: StreamRequest, disconnected: Disconnected | None = None
                     ) -> AsyncIterator[list[SequenceEvent]]:
        try:
            async for batch in stream_events(self._signals, request, self._submit, self.cancel, disconnected):
                yield batch
        finally:
            key = self._keys.get(id(request))
            if key is not None:
                self._forget(key)


def _http_main(requests: Connection, events: Connection, tokenizer: Any, limits: dict[str, Any],
               model_name: str, host: str, port: int, api_key: str | None, stream_interval_s: float) -> None:
    """The child process: uvicorn over a `RemoteBackend`; says "ready" (or why not) on the requests pipe."""
    loop = event_loop()
    try:
        loop.run_until_complete(_http_serve(requests, events, tokenizer, limits, model_name, host, port, api_key,
                                            stream_interval_s))
    finally:
        loop.close()


def event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (``uvicorn[standard]``, the serve extra: less CPU per stream
    chunk than asyncio's), asyncio's otherwise — what uvicorn's own ``loop="auto"`` would pick; `serve` starts
    uvicorn inside a loop of ours, so the choice is made here."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def _http_serve(requests: Connection, events: Connection, tokenizer: Any, limits: dict[str, Any],
                      model_name: str, host: str, port: int, api_key: str | None, stream_interval_s: float) -> None:
    import uvicorn

    from posttrain.serve.app import create_app

    backend = RemoteBackend(requests, events, tokenizer, stream_interval_s=stream_interval_s, **limits)
    app = create_app(backend, model_name, api_key=api_key)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           lifespan="off", timeout_graceful_shutdown=2))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            requests.send(("failed", f"could not listen on {host}:{port} (in use, or not an address of this "
                           "machine)"))
            return
        await asyncio.sleep(0.01)
    backend.attach(asyncio.get_running_loop())
    requests.send(("ready",))
    gone = asyncio.create_task(backend.engine_gone.wait())
    await asyncio.wait([serving, gone], return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    await serving


class HTTPProcess:
    """uvicorn in a child process over `batcher`'s engine; `start` returns when it listens (or raises)."""

    def __init__(self, batcher: ContinuousBatcher, model_name: str, *, host: str, port: int,
                 api_key: str | None, stream_interval_s: float, stop: threading.Event):
        context = multiprocessing.get_context("spawn")
        request_reader, request_writer = context.Pipe(duplex=False)
        event_reader, event_writer = context.Pipe(duplex=False)
        engine = batcher.engine
        limits = {"max_length": engine.max_length, "vocab_size": engine.vocab_size,
                  "max_batch_size": batcher.max_batch_size}
        self.process = context.Process(
            target=_http_main, name="posttrain-http",
            args=(request_writer, event_reader, engine.tokenizer, limits, model_name, host, port, api_key,
                  stream_interval_s), daemon=True)
        self._requests, self._ends = request_reader, (request_writer, event_reader)
        self.link = EngineLink(batcher, request_reader, event_writer, stop)
        self.host, self.port = host, port

    def start(self) -> None:
        self.process.start()
        for end in self._ends:  # the child holds these now: EOF on ours means the child is gone
            end.close()
        try:
            message = self._requests.recv()
        except EOFError:
            message = ("failed", f"the HTTP process exited with code {self.process.exitcode} before listening")
        if message[0] != "ready":
            self.process.join(timeout=5)
            raise ServeError(message[1])
        self.link.start()

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(timeout=10)
