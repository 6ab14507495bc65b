"""Load a checkpoint into a backend and run the HTTP server (uvicorn) beside the engine loop.

Two layouts. The default (`serve`, ``posttrain serve``): the engine loop on this process's main thread — on a
CPU torch's OpenMP work is fastest on the thread that already owns its pool (docs/rollout.md: 64 x 32 tokens
of tiny-3m took 0.08 s from the main thread, 0.19 s from a worker thread) — and uvicorn in a child process
(`posttrain.serve.remote`), so the HTTP work never holds the engine's GIL. ``http_process=False``
(``--http-thread``) keeps uvicorn on a second thread of this process, the layout `start_server` uses by default
for tests and benchmarks that drive the server from the same process (``start_server(..., http_process=True)``
starts the child instead). Backends without a `ContinuousBatcher` (vLLM, speculative decoding) always use a
thread. One function (`_start_http`) starts either layout for both.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import uvicorn

from posttrain.serve.app import create_app
from posttrain.serve.backends import STREAM_INTERVAL_S, HFBackend, VLLMBackend
from posttrain.serve.errors import ServeError
from posttrain.serve.remote import HTTPProcess

log = logging.getLogger(__name__)


def load_engine(checkpoint: str | Path, *, device: str = "auto", precision: str = "auto",
                max_batch_size: int = 64, num_threads: int | None = None, draft: str | None = None,
                num_draft_tokens: int = 4, ngram: int = 3) -> Any:
    """An `HFEngine` on the Hugging Face directory `checkpoint` (a posttrain checkpoint or any local causal LM);
    `draft` ("ngram", or a model directory with the same tokenizer) turns on speculative decoding."""
    from posttrain.config import ModelConfig, RuntimeConfig
    from posttrain.models import autocast_dtype, load_model, load_tokenizer, resolve_device
    from posttrain.rollout import HFEngine, load_speculation

    path = Path(checkpoint)
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        raise ServeError(f"{checkpoint}: a LoRA adapter alone (model.lora.merge_on_save: false); merge it first: "
                         f"posttrain export RUN_DIR DEST, then serve DEST")
    if not (path / "config.json").is_file():
        raise ServeError(f"{checkpoint}: not a model directory (no config.json); give a checkpoint directory, "
                         "e.g. runs/sft/final")
    config = ModelConfig(path=str(path))
    runtime = RuntimeConfig(device=device, precision=precision)  # type: ignore[arg-type]
    target = resolve_device(runtime)
    tokenizer = load_tokenizer(config)
    model = load_model(config, tokenizer, target)
    return HFEngine(model, tokenizer, autocast=autocast_dtype(runtime, target), max_batch_size=max_batch_size,
                    num_threads=num_threads,
                    speculative=load_speculation(draft, tokenizer, num_tokens=num_draft_tokens, ngram=ngram))


def serving_threads(device: str = "auto") -> int | None:
    """Torch threads for a served engine when none are asked for (``posttrain serve`` without ``--threads``).

    On a CPU: every core torch would use but one, which the HTTP side gets (uvicorn, the streams' JSON and
    detokenization; on one machine the clients too). Given every core, the engine's OpenMP team stalls whenever
    the HTTP side takes one of them (a decode step of a small model is many short parallel regions, each waiting
    for its slowest thread), so the HTTP side's CPU is added to the served wall time instead of overlapping it
    (docs/serve.md has the figures). With one core left, the two run side by side. None on a GPU: torch's
    default."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return None
    return max(1, torch.get_num_threads() - 1)


def make_backend(checkpoint: str | Path, engine: Literal["hf", "vllm"] = "hf", *,
                 stream_interval_s: float = STREAM_INTERVAL_S, **options: Any) -> Any:
    """The backend for ``--engine``: `HFBackend` (continuous batching) or `VLLMBackend` (untested here).
    `stream_interval_s`: the least time between two stream chunks of a request (hf; `HFBackend`)."""
    if engine == "hf" and options.get("draft"):
        # Speculative rounds run inside `HFEngine.generate`: requests are batched per call, not continuously.
        hf_engine = load_engine(checkpoint, **options)
        return VLLMBackend(hf_engine, hf_engine.max_length, hf_engine.vocab_size)
    if engine == "hf":
        from posttrain.rollout import ContinuousBatcher

        return HFBackend(ContinuousBatcher(load_engine(checkpoint, **options)), stream_interval_s=stream_interval_s)
    if engine == "vllm":
        from transformers import AutoConfig

        from posttrain.rollout import VLLMEngine

        config = AutoConfig.from_pretrained(str(checkpoint))
        max_length = getattr(config, "max_position_embeddings", None)
        return VLLMBackend(VLLMEngine(str(checkpoint), allow_truncated_logprobs=True), max_length,
                           config.vocab_size)
    raise ServeError(f"--engine {engine!r}: use 'hf' or 'vllm'")


def _start_http(backend: Any, model_name: str, host: str, port: int, api_key: str | None, http_process: bool,
                stop: threading.Event) -> Callable[[], None]:
    """Start the HTTP side of `backend` (listening when this returns) and return what stops it; the HTTP side
    going away sets `stop`. With `http_process` (and a backend with a batcher) uvicorn runs in a child process
    (`HTTPProcess`: its pipe closing stops the engine's link), otherwise on a thread of this process."""
    if http_process and isinstance(backend, HFBackend):
        http = HTTPProcess(backend.batcher, model_name, host=host, port=port, api_key=api_key,
                           stream_interval_s=backend.stream_interval_s, stop=stop)
        http.start()
        return http.stop
    if http_process:
        log.info("serve: %s has no continuous batcher; HTTP runs on a thread", type(backend).__name__)
    server = uvicorn.Server(uvicorn.Config(create_app(backend, model_name, api_key=api_key), host=host, port=port,
                                           log_level="warning", access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=2))

    def run() -> None:
        try:
            server.run()
        finally:
            stop.set()

    thread = threading.Thread(target=run, name="posttrain-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise ServeError(f"could not listen on {host}:{port} (in use, or not an address of this machine)")
        time.sleep(0.01)

    def close() -> None:
        server.should_exit = True
        thread.join(timeout=10)

    return close


def serve(backend: Any, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, ready: Any = None, http_process: bool = True) -> None:
    """Serve until interrupted (Ctrl-C): the engine loop on this thread, HTTP in a child process (or, with
    ``http_process=False`` or a backend without a batcher, on a thread of this one)."""
    stop = threading.Event()
    close = _start_http(backend, model_name, host, port, api_key, http_process, stop)
    if ready is not None:
        ready(f"http://{host}:{port}")
    try:
        backend.run(stop)
    except KeyboardInterrupt:
        pass
    finally:
        close()


@dataclass
class ServerHandle:
    """A server started by `start_server`: its base URL (``/v1`` appended for OpenAI clients) and `stop`."""

    url: str
    backend: Any
    _close: Any
    _engine_thread: threading.Thread
    _stop: threading.Event

    def stop(self) -> None:
        self._close()
        self._stop.set()
        self._engine_thread.join(timeout=10)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def start_server(backend: Any, model_name: str, *, host: str = "127.0.0.1", port: int | None = None,
                 api_key: str | None = None, http_process: bool = False) -> ServerHandle:
    """Serve in the background: the same layouts as `serve`, but the engine loop on a thread (HTTP on another
    by default, or with ``http_process`` in a child process); stop with ``handle.stop()``."""
    port = port or free_port(host)
    stop = threading.Event()
    close = _start_http(backend, model_name, host, port, api_key, http_process, stop)
    engine_thread = threading.Thread(target=backend.run, args=(stop,), name="posttrain-engine", daemon=True)
    engine_thread.start()
    return ServerHandle(f"http://{host}:{port}", backend, close, engine_thread, stop)
