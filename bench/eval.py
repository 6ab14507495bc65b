"""Evaluation throughput: items/s of `posttrain.evaluate` for a tiny model over 500 single-turn items.

    .venv/bin/python bench/eval.py [--items 500] [--preset tiny-3m] [--batch-size 128] [--max-new-tokens 32]

A freshly built tiny model (saved and loaded like any checkpoint) answers held-out arithmetic items greedily
through `load_policy` + `run_items`: one `HFEngine`, the episodes in flight batched by `AsyncBatcher`, each
answer judged by the task's verifier. The workload is fixed: an untrained model rarely stops early, so nearly
every item costs `max_new_tokens` tokens (the demo's trained model answers in about 35). For comparison, the
same loop one episode at a time (batch size 1) over the first `--sequential` items. Figures are medians over
`--repeats` runs (the machine is shared). Ends with exactly one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from posttrain.config import EvalRuntime, EvalSampling
from posttrain.evaluate import load_policy, run_items
from posttrain.models import build_tiny_model, save_model_dir, train_tokenizer
from posttrain.tasks import get_domain, sample_tasks


def build_checkpoint(directory: Path, preset: str) -> Path:
    source = get_domain("arithmetic")
    texts = []
    for task in sample_tasks(source, 400, level=[1, 2, 3], seed=0):
        sample = source.demonstration(task)
        texts += [m["content"] for m in sample.messages] + [sample.metadata.reasoning_trace or ""]
    tokenizer = train_tokenizer(texts, vocab_size=512)
    save_model_dir(directory, build_tiny_model(preset, tokenizer, seed=0), tokenizer)
    return directory


def measure(policy, tasks, sampling: EvalSampling, runtime: EvalRuntime) -> tuple[float, float, int]:
    items, stats = run_items(policy, tasks, sampling, runtime)
    assert len(items) == len(tasks)
    return len(tasks) / stats.seconds, stats.policy_tokens / stats.seconds, stats.threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=500)
    parser.add_argument("--preset", default="tiny-3m")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--sequential", type=int, default=40, help="items for the one-at-a-time baseline")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="engine threads (default: all but one on a CPU, see posttrain.evaluate.runner)")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]

    tasks = sample_tasks(get_domain("arithmetic"), args.items, level=3, split="heldout", seed=0)
    sampling = EvalSampling(max_new_tokens=args.max_new_tokens)
    # A generous timeout: on a shared CPU a batch can outlast a task's 10 s, and this measures throughput.
    batched = EvalRuntime(batch_size=args.batch_size, precision=args.precision, timeout_scale=30.0,
                          num_threads=args.threads)
    single = EvalRuntime(batch_size=1, max_concurrency=1, precision=args.precision, timeout_scale=30.0,
                         num_threads=args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        policy = load_policy(build_checkpoint(Path(tmp) / "model", args.preset), batched)
        measure(policy, tasks[:32], sampling, batched)  # warm-up
        runs = []
        for repeat in range(args.repeats):
            started = time.perf_counter()
            runs.append(measure(policy, tasks, sampling, batched))
            print(f"batched run {repeat + 1}: {runs[-1][0]:.1f} items/s, {runs[-1][1]:,.0f} tokens/s "
                  f"({time.perf_counter() - started:.1f}s)", flush=True)
        sequential = [measure(policy, tasks[: args.sequential], sampling, single) for _ in range(args.repeats)]
        print(f"one at a time: {statistics.median(s[0] for s in sequential):.1f} items/s", flush=True)
    items_per_s = statistics.median(r[0] for r in runs)
    sequential_items_per_s = statistics.median(s[0] for s in sequential)
    print(json.dumps({"load_avg_1m": [round(load_start, 1), round(os.getloadavg()[0], 1)],
        "bench": "eval", "preset": args.preset, "items": args.items, "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens, "precision": args.precision, "engine_threads": runs[-1][2],
        "items_per_s": round(items_per_s, 2),
        "tokens_per_s": round(statistics.median(r[1] for r in runs)),
        "sequential_items_per_s": round(sequential_items_per_s, 2),
        "speedup": round(items_per_s / sequential_items_per_s, 1),
    }))


if __name__ == "__main__":
    main()
