"""Served vs offline: 64 concurrent streaming chat clients against `posttrain serve`, on tiny-3m.

    .venv/bin/python bench/serve.py [--clients 64] [--max-tokens 32] [--repeats 3] [--precision auto] [--threads N]
                                    [--stream-interval SECONDS] [--layout process|thread] [--no-baseline]

One random-init tiny-3m checkpoint is saved to a temporary directory and served by the real command
(`posttrain serve`, a subprocess: its engine loop on its main thread, uvicorn in a child process of its own, or
with ``--layout thread`` on a second thread, ``--http-thread``), with serve's own torch threads (on a CPU every
core but one, left to the HTTP side) unless ``--threads`` sets both sides'. Per repeat, in turn:

* served: ``--clients`` concurrent streaming chat requests from the official `openai` async client, temperature
  1, request i seeded with i; completion tokens/s over the wall time from the first request sent to the last
  stream closed, and each request's time to first token (its first content chunk). The clients run in this
  process, not the server's (they never hold the server's GIL; they do share the machine's cores), and keep
  their connections open across runs: two untimed warm-up rounds of all clients open them first. The server's
  own mean time to first token (submitted to first token sampled, from its /metrics) is reported beside it;
* offline: the same engine (`HFEngine` loaded from the same checkpoint, in this process) generating the same
  prompts in one ``generate`` call with the same per-request seeds — so both sides sample the same tokens;
* baseline: transformers' ``model.generate`` on the same model, one request at a time (what a server without
  batching does); its time to first token for request i is when its turn comes plus its first token.

Figures are medians over the repeats (the machine is shared). Beside the rates, the CPU seconds each side
used per run (``served_cpu_s``: the server's engine process, its HTTP process, the clients; ``offline_cpu_s``),
which a loaded machine disturbs less than the wall clock. Ends with one JSON line; ``ratio`` is served
tokens/s over offline tokens/s (target >= 0.8).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from posttrain.models import build_tiny_model, save_model_dir, train_tokenizer
from posttrain.serve import free_port, load_engine, serving_threads
from posttrain.types import GenerationRequest, SamplingParams

MODEL = "tiny-3m"


def make_checkpoint(directory: Path) -> Path:
    rng = random.Random(0)
    corpus = [f"What is {rng.randint(0, 999)} + {rng.randint(0, 999)}? Think step by step." for _ in range(500)]
    corpus += [f"{a} + {b} = {a + b}. The answer is {a + b}." for a, b in ((rng.randint(0, 99), 7) for _ in range(500))]
    tokenizer = train_tokenizer(corpus, vocab_size=512)
    save_model_dir(directory, build_tiny_model(MODEL, tokenizer, seed=0), tokenizer)
    return directory


def chats(clients: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"What is {17 * i + 3} + {29 * i + 11}?"}] for i in range(clients)]


def encode_chats(tokenizer, prompts: list[list[dict]]) -> list[list[int]]:
    """Each chat's prompt ids, by the tokenizer's chat template (what the server sends the engine)."""
    prompt_ids = []
    for messages in prompts:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt_ids.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    return prompt_ids


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def all_clients(one, prompts: list[list[dict]], max_tokens: int) -> tuple[int, float, list[float]]:
    """Every client's request at once (``one(index, messages, max_tokens, started)``): completion tokens, wall
    seconds from the first request sent to the last stream closed, and each request's time to first token."""
    started = time.perf_counter()
    results = await asyncio.gather(*(one(i, m, max_tokens, started) for i, m in enumerate(prompts)))
    return sum(t for t, _ in results), time.perf_counter() - started, [f for _, f in results]


class Clients:
    """`count` concurrent streaming chat clients: one `openai.AsyncOpenAI` (its connection pool kept open across
    runs, so a timed run does not pay for connecting) on one event loop, in this process — not the server's."""

    def __init__(self, url: str):
        import openai

        self.loop = asyncio.new_event_loop()
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)

    async def _one(self, index: int, messages: list[dict], max_tokens: int, started: float) -> tuple[int, float]:
        stream = await self.client.chat.completions.create(
            model=MODEL, messages=messages, temperature=1.0, seed=index, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True})
        first, tokens = None, 0
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - started
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens, first if first is not None else time.perf_counter() - started

    def run(self, prompts: list[list[dict]], max_tokens: int) -> tuple[int, float, list[float]]:
        """Completion tokens, wall seconds (first request sent to last stream closed), per-request TTFTs."""
        return self.loop.run_until_complete(all_clients(self._one, prompts, max_tokens))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


class RawClients:
    """`count` concurrent streaming chat clients on bare asyncio sockets: one kept-alive HTTP/1.1 connection
    each, the body read as chunked server-sent events, and only the last event (the usage chunk) parsed as JSON.
    The lean client a serving benchmark uses, so that the client side takes as little of the two cores as it can;
    `Clients` (the `openai` SDK, which parses every chunk into pydantic objects) is ``--client openai``."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.loop = asyncio.new_event_loop()
        self.connections: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connection(self, index: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while len(self.connections) <= index:
            self.connections.append(await asyncio.open_connection(self.host, self.port))
        return self.connections[index]

    async def _one(self, index: int, messages: list[dict], max_tokens: int, started: float) -> tuple[int, float]:
        body = json.dumps({"model": MODEL, "messages": messages, "temperature": 1.0, "seed": index,
                           "max_tokens": max_tokens, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % (self.host.encode(), len(body)) + body)
        reader, writer = await self._connection(index)
        try:
            writer.write(request)
            status = await reader.readline()
        except ConnectionError:  # closed by the server while idle, and reset (httptools) rather than ended
            status = b""
        if not status:  # the server closed the idle kept-alive connection (uvicorn: after 5 s): open a new one
            self.connections[index] = reader, writer = await asyncio.open_connection(self.host, self.port)
            writer.write(request)
            status = await reader.readline()
        if b" 200 " not in status:
            raise SystemExit(f"request {index}: {status.decode().strip()}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # headers (the body is chunked: uvicorn streams a response of unknown length that way)
        first, last_event, pending = None, b"", b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            if size == 0:
                await reader.readline()
                break
            pending += (await reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if first is None and b'"content":"' in event and b'"content":""' not in event:
                    first = time.perf_counter() - started
                if event != b"data: [DONE]":
                    last_event = event
        usage = json.loads(last_event.removeprefix(b"data: ")).get("usage") or {}
        return usage.get("completion_tokens", 0), first if first is not None else time.perf_counter() - started

    def run(self, prompts: list[list[dict]], max_tokens: int) -> tuple[int, float, list[float]]:
        """Completion tokens, wall seconds (first request sent to last stream closed), per-request TTFTs."""
        return self.loop.run_until_complete(all_clients(self._one, prompts, max_tokens))

    def close(self) -> None:
        for _, writer in self.connections:
            writer.close()
        self.loop.close()


def offline(engine, prompt_ids: list[list[int]], max_tokens: int) -> tuple[int, float]:
    sampling = SamplingParams(max_new_tokens=max_tokens, temperature=1.0, include_stop_in_output=False)
    started = time.perf_counter()
    groups = engine.generate([GenerationRequest(p) for p in prompt_ids], sampling,
                             request_seeds=list(range(len(prompt_ids))))
    return sum(len(g[0].token_ids) for g in groups), time.perf_counter() - started


def baseline(model, tokenizer, prompt_ids: list[list[int]], max_tokens: int) -> tuple[int, float, list[float]]:
    """transformers' generate, one request after another; TTFT = when the request's turn came + prefill."""
    tokens, ttfts = 0, []
    started = time.perf_counter()
    with torch.inference_mode():
        for ids in prompt_ids:
            turn = time.perf_counter() - started
            inputs = torch.tensor([ids])
            first = time.perf_counter()
            model(input_ids=inputs)  # the prefill: when its first token would be there
            ttfts.append(turn + time.perf_counter() - first)
            output = model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=True, top_k=0,
                                    max_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id)
            new = output[0, len(ids):].tolist()
            if tokenizer.eos_token_id in new:
                new = new[: new.index(tokenizer.eos_token_id)]
            tokens += len(new)
    return tokens, time.perf_counter() - started, ttfts


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_processes(pid: int) -> dict[str, int]:
    """The server's engine process and, with the process layout, its HTTP child (multiprocessing's spawned
    process; not its resource tracker)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    http = [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return {"engine": pid, **({"http": http[0]} if http else {})}


def server_ttft(url: str) -> tuple[float, int]:
    """The server's own time-to-first-token sum and count (submitted to first token sampled, from /metrics)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(
        "posttrain_time_to_first_token_seconds_"))
    return (float(values.get("posttrain_time_to_first_token_seconds_sum", 0)),
            int(float(values.get("posttrain_time_to_first_token_seconds_count", 0))))


def start_server(checkpoint: Path, port: int, precision: str, threads: int | None,
                 stream_interval: float, layout: str) -> subprocess.Popen:
    source = Path(__file__).resolve().parent.parent / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-m", "posttrain", "serve", str(checkpoint), "--port", str(port), "--model-name", MODEL,
         "--precision", precision, "--stream-interval", str(stream_interval),
         *(["--threads", str(threads)] if threads else []), *(["--http-thread"] if layout == "thread" else [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen = []  # warnings a library prints on import (torchao's, say) come before the banner
    while not seen or "127.0.0.1" not in seen[-1]:
        line = process.stdout.readline()
        if not line:
            process.kill()
            raise SystemExit("the server did not start:\n" + "".join(seen))
        seen.append(line)
    # Keep reading what the server prints (a full pipe would block its writes, and with them the server), the
    # last lines kept for the report of a failed run.
    process.lines = collections.deque(maxlen=40)
    threading.Thread(target=lambda: process.lines.extend(process.stdout), daemon=True).start()
    return process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for the server's engine and the offline engine (default: torch's for "
                             "offline, serve's own for the server: all cores but one on a CPU)")
    parser.add_argument("--client", default="raw", choices=["raw", "openai"],
                        help="raw: lean asyncio clients that parse only the usage chunk; openai: the official SDK")
    parser.add_argument("--stream-interval", type=float, default=0.0,
                        help="the server's --stream-interval (seconds between a request's stream chunks at least)")
    parser.add_argument("--layout", default="process", choices=["process", "thread"],
                        help="the server's HTTP side: in a process of its own (the default) or on a thread")
    parser.add_argument("--no-baseline", action="store_true", help="skip transformers' one-at-a-time baseline")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    loads = [os.getloadavg()[0]]  # the machine is shared: the load the figures were measured at
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = make_checkpoint(Path(scratch) / MODEL)
        engine = load_engine(checkpoint, precision=args.precision, num_threads=args.threads)
        prompts = chats(args.clients)
        prompt_ids = encode_chats(engine.tokenizer, prompts)
        port = free_port()
        server = start_server(checkpoint, port, args.precision, args.threads, args.stream_interval, args.layout)
        url = f"http://127.0.0.1:{port}"
        clients = RawClients(url) if args.client == "raw" else Clients(url)
        try:
            for _ in range(2):  # warm-up: every client's connection, the server's first requests and steps
                clients.run(prompts, 4)
            offline(engine, prompt_ids, 4)
            pieces = server_processes(server.pid)  # CPU seconds per served run, per process
            served_rates, offline_rates, ttft50, ttft95, inside = [], [], [], [], []
            served_cpu: list[dict[str, float]] = []
            offline_cpu: list[float] = []
            for repeat in range(args.repeats):
                order = ("served", "offline") if repeat % 2 == 0 else ("offline", "served")
                for side in order:
                    if side == "served":
                        before = server_ttft(url)
                        cpu_before = {k: process_cpu_s(p) for k, p in pieces.items()}, time.process_time()
                        tokens, seconds, ttfts = clients.run(prompts, args.max_tokens)
                        served_cpu.append({**{k: process_cpu_s(p) - cpu_before[0][k] for k, p in pieces.items()},
                                           "clients": time.process_time() - cpu_before[1]})
                        after = server_ttft(url)
                        inside.append((after[0] - before[0]) / max(1, after[1] - before[1]))
                        served_rates.append(tokens / seconds)
                        ttft50.append(percentile(ttfts, 0.5))
                        ttft95.append(percentile(ttfts, 0.95))
                    else:
                        cpu_before = time.process_time()
                        tokens, seconds = offline(engine, prompt_ids, args.max_tokens)
                        offline_cpu.append(time.process_time() - cpu_before)
                        offline_rates.append(tokens / seconds)
                print(f"repeat {repeat} (load {os.getloadavg()[0]:.1f}): served {served_rates[-1]:,.0f} tok/s, "
                      f"offline {offline_rates[-1]:,.0f} tok/s, TTFT p50 {ttft50[-1] * 1000:.0f} ms "
                      f"p95 {ttft95[-1] * 1000:.0f} ms; CPU s served "
                      + " ".join(f"{k} {v:.2f}" for k, v in served_cpu[-1].items())
                      + f", offline {offline_cpu[-1]:.2f}", flush=True)
        except BaseException:
            print("the server's last lines:\n" + "".join(server.lines), file=sys.stderr)
            raise
        finally:
            clients.close()
            server.terminate()
            server.wait(timeout=30)
        if not args.no_baseline:
            base_tokens, base_seconds, base_ttfts = baseline(engine.model, engine.tokenizer, prompt_ids,
                                                             args.max_tokens)

    served_rate, offline_rate = statistics.median(served_rates), statistics.median(offline_rates)
    result = {
        "bench": "serve", "model": MODEL, "clients": args.clients, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "precision": args.precision, "client": args.client,
        "stream_interval_s": args.stream_interval, "threads": torch.get_num_threads(),
        "server_threads": args.threads or serving_threads(),  # serve's default on a CPU: all cores but one
        "served_tokens_per_s": round(served_rate, 1), "offline_tokens_per_s": round(offline_rate, 1),
        "ttft_p50_ms": round(statistics.median(ttft50) * 1000, 1),
        "ttft_p95_ms": round(statistics.median(ttft95) * 1000, 1),
        "server_ttft_mean_ms": round(statistics.median(inside) * 1000, 1),
        "layout": args.layout,
        # CPU seconds per run (medians; less sensitive to the machine's load than the wall-clock rates): the
        # server's engine process, its HTTP process (process layout), the clients (this process), and offline
        "served_cpu_s": {k: round(statistics.median(c[k] for c in served_cpu), 3) for k in served_cpu[0]},
        "offline_cpu_s": round(statistics.median(offline_cpu), 3),
        "load_avg_1m": [round(load, 1) for load in loads] + [round(os.getloadavg()[0], 1)],
        "ratio": round(served_rate / offline_rate, 3),
    }
    if not args.no_baseline:
        result.update({
            "baseline_tokens_per_s": round(base_tokens / base_seconds, 1),
            "baseline_ttft_p50_ms": round(percentile(base_ttfts, 0.5) * 1000, 1),
            "baseline_ttft_p95_ms": round(percentile(base_ttfts, 0.95) * 1000, 1),
            "served_over_baseline": round(served_rate / (base_tokens / base_seconds), 2),
        })
    print(json.dumps(result))


if __name__ == "__main__":
    main()
