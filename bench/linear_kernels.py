"""One linear, `F.linear` against the weight prepacked for oneDNN (`posttrain.models.kernels`), GFLOP/s by shape.

    .venv/bin/python bench/linear_kernels.py [--threads 1] [--repeats 5]

The shapes docs/benchmarks.md cites ("fp32 generation: MKL was the floor"): the tiny models' decode shapes at 64
rows and at 1-8 rows, and Qwen2-0.5B-like ones, in float32 and bfloat16. Per shape the two kernels alternate,
each timed over enough calls for ~30 ms, medians over the repeats. Ends with one JSON line: per dtype and shape
both rates and their ratio, and ``"ratio"``: the median fp32 ratio over the 64-row shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from posttrain.models import prepack, prepacked_linear

SHAPES = [(1, 256, 768), (2, 256, 512), (4, 256, 512), (8, 256, 768), (64, 256, 768), (64, 256, 1024),
          (64, 512, 256), (1, 896, 1152), (1, 1024, 2048), (64, 896, 1152), (64, 4864, 896), (2048, 256, 768)]


def rate(call, flops: float) -> float:
    for _ in range(3):
        call()
    calls = max(5, int(3e7 / max(flops, 1)))  # ~30 ms at ~1 GFLOP/ms
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return flops * calls / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = [round(os.getloadavg()[0], 1)]
    results: dict[str, dict[str, dict[str, float]]] = {}
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        results[name] = {}
        for rows, inner, out in SHAPES:
            x = torch.randn(rows, inner, generator=generator).to(dtype)
            weight = torch.randn(out, inner, generator=generator).to(dtype)
            packed = prepack(weight)
            if packed is None:
                continue  # no oneDNN linears for this dtype in this build
            flops = 2.0 * rows * inner * out
            plain, fast = [], []
            with torch.inference_mode():
                for repeat in range(args.repeats):
                    sides = [(plain, lambda: F.linear(x, weight)), (fast, lambda: prepacked_linear(x, weight, None,
                                                                                                     packed))]
                    for figures, call in sides if repeat % 2 == 0 else sides[::-1]:
                        figures.append(rate(call, flops))
            key = f"{rows}x{inner}->{out}"
            results[name][key] = {"f_linear_gflops": round(statistics.median(plain), 1),
                                  "prepacked_gflops": round(statistics.median(fast), 1),
                                  "ratio": round(statistics.median(fast) / statistics.median(plain), 2)}
            print(f"{name:8s} {key:16s} F.linear {results[name][key]['f_linear_gflops']:7.1f}  prepacked "
                  f"{results[name][key]['prepacked_gflops']:7.1f} GFLOP/s  {results[name][key]['ratio']:.2f}x")
    load.append(round(os.getloadavg()[0], 1))
    wide = [v["ratio"] for k, v in results.get("float32", {}).items() if k.startswith("64x")]
    print(json.dumps({"bench": "linear_kernels", "threads": args.threads, "repeats": args.repeats,
                      "results": results, "ratio": statistics.median(wide) if wide else None, "load_avg_1m": load}))


if __name__ == "__main__":
    main()
