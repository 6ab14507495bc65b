"""One long prompt through the engine: peak memory and time with chunked prefill and the KV cache in the model's
dtype (the defaults) against a one-pass prefill with a float32 cache (the engine before them).

    python bench/long_prompt.py [--prompt 7000] [--n 4] [--new 16]

tiny-3m extended to 8,192 positions (`rope_scaling: yarn x8`), bf16 autocast, 1 thread, one prompt of
`--prompt` tokens sampled `--n` times for `--new` tokens. Each configuration runs in a fresh process (its
resident high-water mark above the mark before `generate` is the figure), alternating, `--repeats` times;
medians. Ends with one JSON line: "memory_ratio" and "time_ratio" are the defaults' over the old path's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {"defaults": ("1024", "auto"), "one_pass_fp32": ("none", "float32")}


def high_water_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return float(line.split()[1]) / 1024
    return 0.0


def worker(chunk: str, kv: str, prompt_tokens: int, n: int, new: int) -> dict:
    import torch

    from posttrain.config import RopeScalingConfig
    from posttrain.models import build_tiny_model, train_tokenizer
    from posttrain.rollout import HFEngine
    from posttrain.types import GenerationRequest, SamplingParams

    torch.set_num_threads(1)
    tokenizer = train_tokenizer([f"long prompt benchmark text number {i}" for i in range(200)], vocab_size=400)
    model = build_tiny_model("tiny-3m", tokenizer, rope_scaling=RopeScalingConfig(type="yarn", factor=8))
    engine = HFEngine(model, tokenizer, autocast="bfloat16", prefill_chunk=None if chunk == "none" else int(chunk),
                      kv_cache_dtype=kv)
    prompt = [(7 * i) % (len(tokenizer) - 30) + 20 for i in range(prompt_tokens)]
    before = high_water_mb()
    started = time.perf_counter()
    engine.generate([GenerationRequest(prompt)], SamplingParams(max_new_tokens=new, n=n, seed=0))
    return {"seconds": time.perf_counter() - started, "rss_above_start_mb": high_water_mb() - before,
            "peak_kv_mb": engine.stats.peak_kv_mb, "kv_cache_dtype": engine.stats.kv_cache_dtype}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--prompt", 7000), ("--n", 4), ("--new", 16), ("--repeats", 2)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # a child process: chunk, kv dtype
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.prompt, args.n, args.new)))
        return 0
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats):
        for name in (list(CONFIGS) if repeat % 2 == 0 else list(CONFIGS)[::-1]):
            command = [sys.executable, __file__, "--worker", *CONFIGS[name], "--prompt", str(args.prompt),
                       "--n", str(args.n), "--new", str(args.new)]
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if done.returncode:
                raise RuntimeError(done.stderr[-3000:])
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    results = {name: {"seconds": round(statistics.median(r["seconds"] for r in rs), 2),
                      "rss_above_start_mb": round(statistics.median(r["rss_above_start_mb"] for r in rs)),
                      "peak_kv_mb": round(rs[0]["peak_kv_mb"], 1), "kv_cache_dtype": rs[0]["kv_cache_dtype"]}
               for name, rs in runs.items()}
    new, old = results["defaults"], results["one_pass_fp32"]
    print(json.dumps({"bench": "long_prompt", "prompt_tokens": args.prompt, "n": args.n, "new_tokens": args.new,
                      "results": results,
                      "memory_ratio": round(new["rss_above_start_mb"] / max(old["rss_above_start_mb"], 1), 3),
                      "time_ratio": round(new["seconds"] / old["seconds"], 3),
                      "loadavg": [round(x, 2) for x in os.getloadavg()]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
