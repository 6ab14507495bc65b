"""Quantization: decode tokens/s and held-out accuracy of int8 and int4 weight-only models against fp32.

    .venv/bin/python bench/quantize.py [--preset tiny-1m] [--steps 150] [--heldout 100] [--repeats 3]

The checkpoint: the built-in tiny model (`--preset`) SFT-trained here for `--steps` steps (`posttrain.train.run_sft`,
the demo's optimizer settings) on 4000 arithmetic demonstrations (one- and two-digit additions, levels 1-2), so
that held-out accuracy is well above zero; then `posttrain.models.quantize_checkpoint` writes its int8 and int4
copies. Accuracy: greedy pass@1 of each on the same `--heldout` held-out items, through `posttrain.evaluate` with
the checkpoints as tiers (fp32 activations everywhere: ``runtime.precision: fp32``). Speed: `measure_tier` on the
same 16 held-out prompts, one request at a time, 32 new tokens at most, the tiers alternated `--repeats` times
(medians reported; the machine is shared). Rows timed:

- fp32, fast runner: the standard tier as `posttrain eval`/`serve` run it (the fused decoder);
- fp32, generic runner: the model's own forward, the path a quantized model takes (the same runner as int8);
- bf16 autocast, fast runner: the low-precision float baseline where the CPU has native bf16;
- int8 and int4: torchao weight-only tensors through the model's own forward.

``ratio`` = int8 tokens/s over fp32 (fast); ``ratio_same_runner`` = int8 over fp32 (generic);
``accuracy_delta`` = int8 pass@1 minus fp32's. Ends with exactly one JSON line. About 10 minutes on a 2-core
machine at load 15 (the SFT steps are most of it; `--steps 100` shortens it).
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


def train_checkpoint(root: Path, preset: str, steps: int) -> Path:
    from posttrain.config import SFTRecipe
    from posttrain.models import build_tiny_model, save_model_dir, train_tokenizer
    from posttrain.tasks import get_domain, sample_tasks
    from posttrain.train import run_sft

    domain = get_domain("arithmetic", operators="+")
    samples = [domain.demonstration(task) for task in sample_tasks(domain, 4000, level=[1, 2], seed=0)]
    texts = [m["content"] for s in samples for m in s.messages] + [s.metadata.reasoning_trace or "" for s in samples]
    tokenizer = train_tokenizer(texts, vocab_size=512)
    base = save_model_dir(root / "base", build_tiny_model(preset, tokenizer, seed=0), tokenizer)
    data = root / "sft.jsonl"
    data.write_text("\n".join(json.dumps(s.to_dict()) for s in samples))
    recipe = SFTRecipe.model_validate({
        "output_dir": str(root / "sft"), "model": {"path": str(base)},
        "data": {"train": [{"path": str(data)}], "max_length": 96, "pack": True},
        "optim": {"lr": 2.0e-3, "warmup_steps": 20, "schedule": "cosine", "min_lr_ratio": 0.1},
        "train": {"batch_size": 32, "max_steps": steps, "log_every": 50},
        "runtime": {"precision": "auto", "seed": 0},
    })
    started = time.perf_counter()
    result = run_sft(recipe)
    print(f"sft: {steps} steps in {time.perf_counter() - started:.0f}s, loss {result.train_loss:.3f}", flush=True)
    return Path(result.final_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-1m")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--heldout", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    bench_started = time.perf_counter()
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    from posttrain.config import EvalRecipe, EvalRuntime, TierEngine
    from posttrain.evaluate import build_suites, evaluate, load_policy, measure_tier, tier_prompts
    from posttrain.models import quantize_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        fp32 = train_checkpoint(root, args.preset, args.steps)
        int8 = quantize_checkpoint(fp32, root / "int8", to="int8")
        int4 = quantize_checkpoint(fp32, root / "int4", to="int4", group_size=32)

        recipe = EvalRecipe.model_validate({
            "output_dir": str(root / "eval"), "fresh_draw": {"enabled": False},
            "suites": {"generated": [{"domain": "arithmetic", "args": {"operators": "+"}, "levels": [1, 2],
                                      "n": args.heldout, "seed": args.seed}]},
            "sampling": {"max_new_tokens": 48},
            "runtime": {"precision": "fp32", "batch_size": 64, "num_threads": 1, "timeout_scale": 30},
            "tiers": {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "repeats": 1, "models": [
                {"label": "fp32", "path": str(fp32)},
                {"label": "int8", "path": str(int8), "kind": "quantized"},
                {"label": "int4", "path": str(int4), "kind": "quantized"}]},
        })
        started = time.perf_counter()
        suites = build_suites(recipe)
        result = evaluate(recipe, suites=suites, write=False)
        accuracy = {row["label"]: row["accuracy"] for row in result.results["tiers"]["rows"]}
        print(f"accuracy ({args.heldout} held-out items): {accuracy} in {time.perf_counter() - started:.0f}s",
              flush=True)

        fp32_runtime = EvalRuntime(precision="fp32", batch_size=1)
        engines = {
            "fp32": load_policy(fp32, fp32_runtime),
            "fp32_generic": load_policy(fp32, fp32_runtime, engine=TierEngine(runner="generic")),
            "bf16": load_policy(fp32, EvalRuntime(precision="bf16", batch_size=1)),
            "int8": load_policy(int8, fp32_runtime),
            "int4": load_policy(int4, fp32_runtime),
        }
        prompts = tier_prompts(suites[0].tasks, engines["fp32"].tokenizer, args.prompts)
        speeds: dict[str, list] = {name: [] for name in engines}
        for repeat in range(args.repeats):
            for name, policy in engines.items():  # alternated, so load drifts hit every row alike
                speeds[name].append(measure_tier(policy.engine, prompts, max_new_tokens=args.max_new_tokens,
                                                 repeats=1, warmup=1 if repeat == 0 else 0))
            print(f"repeat {repeat + 1}: " + ", ".join(f"{n} {s[-1].tokens_per_s:.0f} tok/s" for n, s in
                                                      speeds.items()), flush=True)

    def median(name: str, field: str) -> float:
        return statistics.median(getattr(s, field) for s in speeds[name])

    rows = {name: {"tokens_per_s": round(median(name, "tokens_per_s"), 1),
                   "p50_latency_ms": round(median(name, "p50_latency_ms"), 1),
                   "runner": speeds[name][0].runner} for name in engines}
    for name in ("fp32", "int8", "int4"):
        rows[name]["accuracy"] = accuracy[name]
    print(json.dumps({
        "bench": "quantize", "preset": args.preset, "sft_steps": args.steps, "heldout_items": args.heldout,
        "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "threads": 1,
        "library": "torchao", "rows": rows,
        "ratio": round(rows["int8"]["tokens_per_s"] / rows["fp32"]["tokens_per_s"], 3),
        "ratio_same_runner": round(rows["int8"]["tokens_per_s"] / rows["fp32_generic"]["tokens_per_s"], 3),
        "int4_ratio": round(rows["int4"]["tokens_per_s"] / rows["fp32"]["tokens_per_s"], 3),
        "accuracy_delta": round(accuracy["int8"] - accuracy["fp32"], 4),
        "int4_accuracy_delta": round(accuracy["int4"] - accuracy["fp32"], 4),
        "seconds": round(time.perf_counter() - bench_started), "loadavg": [round(x, 2) for x in os.getloadavg()],
    }))


if __name__ == "__main__":
    main()
