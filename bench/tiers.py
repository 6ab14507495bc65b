"""The tier table, measured: standard, distilled student, speculative decoding (student draft; prompt lookup), int8.

    .venv/bin/python bench/tiers.py [--teacher-steps 150] [--student-steps 200] [--heldout 100] [--repeats 5]
    .venv/bin/python bench/tiers.py --out runs/bench-tiers     # keep results.json and report.html

1. Standard: the built-in tiny model (`--teacher-preset`, tiny-3m) SFT-trained for `--teacher-steps` steps on 4000
   one- and two-digit addition demonstrations (`bench/quantize.py`'s `train_checkpoint`: its own 512-token
   tokenizer, `posttrain.train.run_sft`, seed 0).
2. Distilled: a fresh tiny-1m on the standard model's tokenizer, `posttrain.train.run_distill` for
   `--student-steps` steps, mode ``logit`` (forward KL to the standard model's distributions on the same
   demonstrations).
3. Quantized: `posttrain.models.quantize_checkpoint(standard, to="int8")` (torchao weight-only).
4. `posttrain.evaluate.evaluate` with an eval recipe whose ``tiers:`` lists five rows: ``standard``; ``student``
   (kind distilled); ``spec-student`` (the standard model, ``engine.speculative: {draft: STUDENT, num_tokens: 4}``)
   and ``spec-ngram`` (prompt lookup, ``{draft: ngram, num_tokens: 4}``), both kind speculative; ``int8`` (kind
   quantized). Accuracy: greedy pass@1 on `--heldout` held-out addition items (levels 1-2, the held-out split),
   fp32. Speed: `measure_tier` (batch 1, greedy, `--prompts` held-out prompts, `--max-new-tokens` tokens); the
   eval's own timing pass is replaced by `--repeats` passes with the tiers alternated (load drift hits every row
   alike) and the median of each figure, then the table (speed-ups against standard) and the report are rebuilt.

One JSON line at the end: per tier accuracy, tokens/s, p50 latency, speed-up, acceptance; ``ratio`` = the fastest
tier's tokens/s over standard's; ``load_avg_1m``. 5-6 minutes on the shared 2-core machine at load 2.4-3.8 (the
two trainings are most of it; measured figures in docs/tiers.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

SPEED_FIELDS = ("tokens_per_s", "p50_latency_ms", "p90_latency_ms", "ms_per_token")


def _train_checkpoint():
    """`bench/quantize.py`'s teacher training (one place for the standard model's recipe)."""
    spec = importlib.util.spec_from_file_location("quantize_bench", Path(__file__).with_name("quantize.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.train_checkpoint


def distil_student(root: Path, teacher: Path, steps: int, *, seed: int = 0) -> Path:
    """A fresh tiny-1m on the teacher's tokenizer, logit-distilled (forward KL) on the teacher's SFT data."""
    from posttrain.config import DistillRecipe
    from posttrain.rl import EngineAnswerSampler
    from posttrain.train import run_distill

    recipe = DistillRecipe.model_validate({
        "output_dir": str(root / "student"), "mode": "logit", "teacher": {"path": str(teacher)},
        "model": {"preset": "tiny-1m"},
        "data": {"train": [{"path": str(root / "sft.jsonl")}], "max_length": 96, "heldout_fraction": 0.02},
        "optim": {"lr": 3e-3, "warmup_steps": 10, "schedule": "cosine", "min_lr_ratio": 0.1},
        "train": {"batch_size": 32, "max_steps": steps, "log_every": 25, "eval_every": max(steps, 1)},
        "runtime": {"precision": "fp32", "num_threads": 1, "seed": seed},
        "tracking": {"tensorboard": False, "progress": False},
    })
    started = time.perf_counter()
    result = run_distill(recipe, sampler=EngineAnswerSampler(recipe.tasks, seed=seed))
    print(f"distill: {steps} steps in {time.perf_counter() - started:.0f}s, held-out {result.heldout}", flush=True)
    return Path(result.final_dir)


def tier_recipe(root: Path, standard: Path, student: Path, int8: Path, *, heldout: int, prompts: int,
                max_new_tokens: int, num_tokens: int, seed: int = 0):
    from posttrain.config import EvalRecipe

    return EvalRecipe.model_validate({
        "output_dir": str(root / "eval"), "fresh_draw": {"enabled": False},
        "suites": {"generated": [{"domain": "arithmetic", "args": {"operators": "+"}, "levels": [1, 2],
                                  "n": heldout, "seed": seed}]},
        "sampling": {"max_new_tokens": 48},
        "runtime": {"precision": "fp32", "batch_size": 64, "num_threads": 1, "timeout_scale": 30},
        "tiers": {"prompts": prompts, "max_new_tokens": max_new_tokens, "repeats": 1, "warmup": 1, "models": [
            {"label": "standard", "path": str(standard)},
            {"label": "student", "path": str(student), "kind": "distilled"},
            {"label": "spec-student", "path": str(standard), "kind": "speculative",
             "engine": {"speculative": {"draft": str(student), "num_tokens": num_tokens}}},
            {"label": "spec-ngram", "path": str(standard), "kind": "speculative",
             "engine": {"speculative": {"draft": "ngram", "num_tokens": num_tokens}}},
            {"label": "int8", "path": str(int8), "kind": "quantized"}]},
    })


def alternated_speeds(recipe, suites, repeats: int) -> dict[str, dict[str, Any]]:
    """Every tier's `measure_tier` figures, the tiers alternated `repeats` times; the median of each figure."""
    from posttrain.evaluate import load_policy, measure_tier, tier_prompts

    settings = recipe.tiers
    tasks = [task for suite in suites for task in suite.tasks]
    policies = {t.label: load_policy(t.path, recipe.runtime, engine=t.engine) for t in settings.models}
    prompts = {label: tier_prompts(tasks, p.tokenizer, settings.prompts) for label, p in policies.items()}
    runs: dict[str, list] = {label: [] for label in policies}
    for repeat in range(repeats):
        for label, policy in policies.items():
            runs[label].append(measure_tier(policy.engine, prompts[label], max_new_tokens=settings.max_new_tokens,
                                            repeats=1, warmup=1 if repeat == 0 else 0))
        print(f"repeat {repeat + 1}: " + ", ".join(f"{label} {r[-1].tokens_per_s:.0f} tok/s"
                                                   for label, r in runs.items()), flush=True)
    medians = {}
    for label, speeds in runs.items():
        row = asdict(speeds[-1])
        row.update({field: statistics.median(getattr(s, field) for s in speeds) for field in SPEED_FIELDS})
        row["requests"] = sum(s.requests for s in speeds)
        row["tokens"] = sum(s.tokens for s in speeds)
        medians[label] = row
    return medians


def run(root: Path, *, teacher_preset: str = "tiny-3m", teacher_steps: int = 150, student_steps: int = 200,
        heldout: int = 100, prompts: int = 16, max_new_tokens: int = 32, num_tokens: int = 4, repeats: int = 5,
        seed: int = 0, out: Path | None = None) -> dict[str, Any]:
    """The whole bench in `root`; returns the summary (the JSON line) with the full ``table`` and the eval's
    ``examples`` beside it."""
    from posttrain.evaluate import build_suites, evaluate, tier_table, write_results
    from posttrain.models import quantize_checkpoint

    torch.manual_seed(seed)
    timings = {}
    started = time.perf_counter()
    standard = _train_checkpoint()(root, teacher_preset, teacher_steps)
    timings["standard_sft_s"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    student = distil_student(root, standard, student_steps, seed=seed)
    timings["distill_s"] = round(time.perf_counter() - started, 1)
    int8 = quantize_checkpoint(standard, root / "int8", to="int8")

    recipe = tier_recipe(root, standard, student, int8, heldout=heldout, prompts=prompts,
                         max_new_tokens=max_new_tokens, num_tokens=num_tokens, seed=seed)
    started = time.perf_counter()
    suites = build_suites(recipe)
    result = evaluate(recipe, suites=suites, write=False)
    timings["eval_s"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    medians = alternated_speeds(recipe, suites, repeats)
    timings["timing_s"] = round(time.perf_counter() - started, 1)

    table = result.results["tiers"]
    for row in table["rows"]:
        row.update(medians[row["label"]])
    table = tier_table(table["rows"], recipe.tiers.model_copy(update={"repeats": repeats}), table["accuracy_suites"])
    result.results["tiers"] = table
    if out is not None:
        write_results(result.results, Path(out))
    rows = {row["label"]: {
        "kind": row["kind"], "accuracy": row["accuracy"], "tokens_per_s": round(row["tokens_per_s"], 1),
        "p50_latency_ms": round(row["p50_latency_ms"], 1), "speedup": round(row["speedup"], 3),
        "runner": row["runner"],
        "acceptance_rate": None if row["acceptance_rate"] is None else round(row["acceptance_rate"], 3)}
        for row in table["rows"]}
    fastest = max(rows, key=lambda label: rows[label]["tokens_per_s"])
    return {
        "bench": "tiers", "teacher_preset": teacher_preset, "teacher_steps": teacher_steps,
        "student_preset": "tiny-1m", "student_steps": student_steps, "heldout_items": heldout, "prompts": prompts,
        "max_new_tokens": max_new_tokens, "num_draft_tokens": num_tokens, "repeats": repeats, "seed": seed,
        "threads": 1, "tiers": rows, "fastest": fastest,
        "ratio": round(rows[fastest]["tokens_per_s"] / rows["standard"]["tokens_per_s"], 3),
        "timings_s": timings, "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
        "table": table, "examples": result.results["examples"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher-preset", default="tiny-3m")
    parser.add_argument("--teacher-steps", type=int, default=150)
    parser.add_argument("--student-steps", type=int, default=200)
    parser.add_argument("--heldout", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--num-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write results.json and report.html here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    bench_started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        summary = run(Path(tmp), teacher_preset=args.teacher_preset, teacher_steps=args.teacher_steps,
                      student_steps=args.student_steps, heldout=args.heldout, prompts=args.prompts,
                      max_new_tokens=args.max_new_tokens, num_tokens=args.num_tokens, repeats=args.repeats,
                      seed=args.seed, out=args.out)
    summary.pop("table"), summary.pop("examples")
    summary["seconds"] = round(time.perf_counter() - bench_started)
    summary["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
