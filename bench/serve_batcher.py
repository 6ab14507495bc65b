"""The engine side of serving alone: `ContinuousBatcher` stepping 64 requests submitted together, against
`HFEngine.generate` on the same prompts and seeds (no HTTP, one process), on tiny-3m.

    .venv/bin/python bench/serve_batcher.py [--clients 64] [--max-tokens 32] [--repeats 5] [--threads N]

The checkpoint and chat prompts are `bench/serve.py`'s; request i is seeded with i on both sides, so both
sample the same tokens (checked at the end). Per repeat, alternating: wall and this thread's CPU seconds of the
batcher run (submit all, `step` until idle, taking every request's events after each step, as a server does)
and of the offline call. With more than one torch thread the CPU seconds leave out the other OpenMP threads'.
Ends with one JSON line; ``ratio`` is the median batcher wall time over the median offline one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from posttrain.rollout import ContinuousBatcher, StreamRequest
from posttrain.serve import load_engine
from posttrain.types import GenerationRequest, SamplingParams
from serve import MODEL, chats, encode_chats, make_checkpoint  # bench/serve.py, beside this file


def _sampling(max_tokens: int, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_tokens, temperature=1.0, seed=seed, include_stop_in_output=False)


def batcher_run(batcher: ContinuousBatcher, prompt_ids: list[list[int]], max_tokens: int
                ) -> tuple[float, float, list[list[int]]]:
    requests = [StreamRequest(ids, _sampling(max_tokens, seed=i)) for i, ids in enumerate(prompt_ids)]
    wall, cpu = time.perf_counter(), time.thread_time()
    batcher.submit_many(requests)
    while batcher.step():
        for request in requests:
            request.drain()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return wall, cpu, [r.completions[0].token_ids for r in requests]


def offline_run(engine, prompt_ids: list[list[int]], max_tokens: int) -> tuple[float, float, list[list[int]]]:
    wall, cpu = time.perf_counter(), time.thread_time()
    groups = engine.generate([GenerationRequest(ids) for ids in prompt_ids], _sampling(max_tokens),
                             request_seeds=list(range(len(prompt_ids))))
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return wall, cpu, [g[0].token_ids for g in groups]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as scratch:
        engine = load_engine(make_checkpoint(Path(scratch) / MODEL), num_threads=args.threads)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    prompt_ids = encode_chats(engine.tokenizer, chats(args.clients))
    batcher = ContinuousBatcher(engine)
    batcher_run(batcher, prompt_ids, 4), offline_run(engine, prompt_ids, 4)  # warm-up
    served, offline = [], []
    for repeat in range(args.repeats):
        served.append(batcher_run(batcher, prompt_ids, args.max_tokens))
        offline.append(offline_run(engine, prompt_ids, args.max_tokens))
        print(f"repeat {repeat} (load {os.getloadavg()[0]:.1f}): batcher {served[-1][0] * 1000:.0f} ms wall, "
              f"{served[-1][1] * 1000:.0f} ms CPU; offline {offline[-1][0] * 1000:.0f} ms wall, "
              f"{offline[-1][1] * 1000:.0f} ms CPU", flush=True)
    tokens = sum(len(t) for t in offline[-1][2])
    result = {
        "bench": "serve_batcher", "model": MODEL, "clients": args.clients, "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(), "completion_tokens": tokens,
        "same_tokens": all(s[2] == o[2] for s, o in zip(served, offline)),
        "batcher_wall_s": round(statistics.median(s[0] for s in served), 4),
        "batcher_cpu_s": round(statistics.median(s[1] for s in served), 4),
        "offline_wall_s": round(statistics.median(o[0] for o in offline), 4),
        "offline_cpu_s": round(statistics.median(o[1] for o in offline), 4),
        "load_avg_1m": [round(loads[0], 1), round(os.getloadavg()[0], 1)],
    }
    result["ratio"] = round(result["batcher_wall_s"] / result["offline_wall_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
