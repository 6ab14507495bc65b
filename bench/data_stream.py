"""Streaming vs in-memory SFT data pipeline: peak memory that does not grow with the data, and tokens/s.

    python bench/data_stream.py                       # 1M and 4M rows for memory, 200k for tokens/s
    python bench/data_stream.py --sizes 100000 400000 --speed-rows 50000 --repeats 1   # a quick look

Rows (chat samples in OpenAI messages format, every one distinct, four domains) are written as JSONL into a
temporary directory that is deleted at the end. Every measurement runs in a fresh subprocess, so its peak
RSS (VmHWM; `ru_maxrss` where there is no /proc) is its own: one streaming pass over the file (read, exact
dedup, tokenize, mix by domain, pack into rows of `--max-length`) for each size; and, for tokens/s, the
in-memory pipeline (`prepare_sft_data` + `epoch_rows(0)`) and the streaming one on the same `--speed-rows` rows,
alternating, median of `--repeats`. The tokenizer is the built-in one, trained once on the first 20k rows' text.
Ends with one JSON line: "ratio" is streaming tokens/s over in-memory tokens/s (wall clock); "cpu_ratio" the
same per second of the process's own CPU time (all its threads), which a loaded, shared machine disturbs far less;
"rss_ratio" is the peak RSS at the largest size over the smallest (the target: within 1.1).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("table", "river", "stone", "cloud", "apple", "green", "light", "music", "plant", "sugar", "tiger")
DOMAINS = ("arithmetic", "strings", "sorting", "chat")


def write_rows(path: Path, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for i in range(count):
            domain = DOMAINS[i % 4]
            if domain == "arithmetic":
                a, b = rng.randrange(10**6), rng.randrange(10**6)
                question, answer = f"What is {a}+{b}?", str(a + b)
            elif domain == "strings":
                word = f"{rng.choice(WORDS)}{i}"
                question, answer = f"Reverse the word {word}.", word[::-1]
            elif domain == "sorting":
                numbers = [rng.randrange(100) for _ in range(5)]
                question, answer = f"Sort {numbers} (request {i}).", str(sorted(numbers))
            else:
                question, answer = f"Say something about {rng.choice(WORDS)} number {i}.", f"It is {i} {rng.choice(WORDS)}s."
            record = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                      "metadata": {"domain": domain}}
            handle.write(json.dumps(record) + "\n")


def data_config(path: Path, max_length: int, streaming: bool):
    from posttrain.config import SFTDataConfig

    return SFTDataConfig.model_validate({
        "train": [{"path": str(path)}], "max_length": max_length, "streaming": streaming,
        "mix": {"by": ["domain"], "weights": {"arithmetic": 2, "strings": 1, "sorting": 1, "chat": 1}},
    })


def measure(mode: str, path: Path, tokenizer_dir: Path, max_length: int) -> dict:
    """Run in a subprocess: one pass of `mode` over `path`; tokens, seconds, peak RSS."""
    from transformers import AutoTokenizer

    from posttrain.data import prepare_sft_data
    from posttrain.data.stream import StreamingSFTData

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    started, cpu_started = time.perf_counter(), time.process_time()
    if mode == "memory":
        rows = prepare_sft_data(data_config(path, max_length, False), tokenizer, seed=0).epoch_rows(0)
        tokens, count = sum(len(row) for row in rows), len(rows)
    else:  # the one reading pass (read, dedup, tokenize into the spill), then epoch 0 mixed and packed from it
        data = StreamingSFTData(data_config(path, max_length, True), tokenizer, seed=0)
        tokens = count = 0
        for row in data.iter_rows(0):
            tokens += len(row)
            count += 1
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    return {"mode": mode, "tokens": tokens, "rows": count, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "peak_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """This process's own peak RSS: VmHWM where /proc has it. `ru_maxrss` survives exec on Linux, so a child
    forked from this (already large) bench process would report the parent's RSS at the fork (420 MB here
    against the child's own 350-360 MB)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_child(mode: str, path: Path, tokenizer_dir: Path, max_length: int) -> dict:
    command = [sys.executable, __file__, "--child", mode, str(path), str(tokenizer_dir), str(max_length)]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if result.returncode:
        raise SystemExit(result.stderr)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs=2, default=[1_000_000, 4_000_000])
    parser.add_argument("--speed-rows", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, path, tokenizer_dir, max_length = args.child
        print(json.dumps(measure(mode, Path(path), Path(tokenizer_dir), int(max_length))))
        return

    from posttrain.data import iter_samples
    from posttrain.models import train_tokenizer

    workdir = Path(tempfile.mkdtemp(prefix="posttrain-data-stream-"))
    try:
        paths = {}
        for size in sorted({*args.sizes, args.speed_rows}):
            paths[size] = workdir / f"rows-{size}.jsonl"
            write_rows(paths[size], size)
        texts = [m["content"] for i, s in zip(range(20_000), iter_samples(paths[min(paths)])) for m in s.messages]
        tokenizer_dir = workdir / "tokenizer"
        train_tokenizer(texts).save_pretrained(tokenizer_dir)

        memory_runs = [run_child("stream", paths[size], tokenizer_dir, args.max_length) for size in args.sizes]
        for run in memory_runs:
            print(f"stream {run['tokens']:,} tokens ({run['rows']:,} rows) in {run['seconds']:.0f}s: "
                  f"peak RSS {run['peak_rss_mb']:.0f} MB", file=sys.stderr)
        speed: dict[str, list[float]] = {"memory": [], "stream": []}
        cpu_speed: dict[str, list[float]] = {"memory": [], "stream": []}
        for _ in range(args.repeats):
            for mode in ("memory", "stream"):
                run = run_child(mode, paths[args.speed_rows], tokenizer_dir, args.max_length)
                speed[mode].append(run["tokens"] / run["seconds"])
                cpu_speed[mode].append(run["tokens"] / run["cpu_seconds"])
                print(f"{mode} {args.speed_rows:,} rows: {run['tokens'] / run['seconds']:,.0f} tokens/s, "
                      f"{run['tokens'] / run['cpu_seconds']:,.0f} tokens per CPU-s, "
                      f"peak RSS {run['peak_rss_mb']:.0f} MB", file=sys.stderr)
        memory_tps, stream_tps = statistics.median(speed["memory"]), statistics.median(speed["stream"])
        print(json.dumps({
            "bench": "data_stream",
            "rss_mb": {str(size): round(run["peak_rss_mb"], 1) for size, run in zip(args.sizes, memory_runs)},
            "rss_ratio": round(memory_runs[-1]["peak_rss_mb"] / memory_runs[0]["peak_rss_mb"], 3),
            "stream_tokens_per_s": round(stream_tps), "memory_tokens_per_s": round(memory_tps),
            "ratio": round(stream_tps / memory_tps, 3),
            "cpu_ratio": round(statistics.median(cpu_speed["stream"]) / statistics.median(cpu_speed["memory"]), 3),
            "speed_rows": args.speed_rows,
            "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
        }))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
