"""`posttrain serve CHECKPOINT` and `posttrain chat CHECKPOINT`: use a trained model (see docs/serve.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(name: str, sub: argparse.ArgumentParser) -> None:
    sub.add_argument("checkpoint", help="a Hugging Face model directory (e.g. runs/sft/final)")
    sub.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    sub.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                     help="matmul precision (auto: bf16 where the device runs it fast)")
    sub.add_argument("--threads", type=int, default=None,
                     help="torch threads for the engine (serve on a CPU: all cores but one, left to the HTTP side)")
    sub.add_argument("--draft", default=None, help="speculative decoding: 'ngram' (prompt lookup) or a draft model "
                     "directory with the same tokenizer (hf engine; requests are then batched per call)")
    sub.add_argument("--num-draft-tokens", type=int, default=4, help="tokens drafted per speculative round")
    if name == "serve":
        sub.add_argument("--engine", default="hf", choices=["hf", "vllm"],
                         help="hf: the built-in engine with continuous batching; vllm: GPU (untested here)")
        sub.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
        sub.add_argument("--port", type=int, default=8000)
        sub.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
        sub.add_argument("--model-name", default=None, help="the model id clients send (default: the directory name)")
        sub.add_argument("--max-batch-size", type=int, default=64, help="sequences decoded together at most")
        sub.add_argument("--stream-interval", type=float, default=0.0,
                         help="seconds between two stream chunks of a request at least (0: every decode step)")
        sub.add_argument("--http-thread", action="store_true",
                         help="run uvicorn on a thread of the engine's process instead of a process of its own")
    else:
        sub.add_argument("--system", default=None, help="system prompt")
        sub.add_argument("--temperature", type=float, default=0.7)
        sub.add_argument("--top-p", type=float, default=1.0)
        sub.add_argument("--max-tokens", type=int, default=256)
        sub.add_argument("--seed", type=int, default=None)
        sub.add_argument("--tools", default="", help="comma-separated built-in tools the model may call "
                         "(e.g. calculator)")


def serve(args: argparse.Namespace) -> int:
    from posttrain.serve import make_backend, serving_threads
    from posttrain.serve import serve as run

    threads = args.threads if args.threads is not None else serving_threads(args.device)
    options = {"device": args.device, "precision": args.precision, "num_threads": threads,
               "max_batch_size": args.max_batch_size, "draft": args.draft, "num_draft_tokens": args.num_draft_tokens}
    if args.engine == "hf":
        backend = make_backend(args.checkpoint, "hf", stream_interval_s=args.stream_interval, **options)
    else:
        backend = make_backend(args.checkpoint, args.engine)
    name = args.model_name or Path(args.checkpoint).resolve().name
    run(backend, name, host=args.host, port=args.port, api_key=args.api_key, http_process=not args.http_thread,
        ready=lambda url: print(f"[serve] {name} at {url}/v1 (Ctrl-C stops)", flush=True))
    return 0


def chat(args: argparse.Namespace) -> int:
    from posttrain.serve import load_engine
    from posttrain.serve import ChatSettings, run_chat

    engine = load_engine(args.checkpoint, device=args.device, precision=args.precision, num_threads=args.threads,
                         draft=args.draft, num_draft_tokens=args.num_draft_tokens)
    settings = ChatSettings(system=args.system, temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed,
                            tools=[t for t in args.tools.split(",") if t])
    run_chat(engine, settings, sys.stdin, sys.stdout)
    return 0
