"""Completion tokens/s of the built-in engine (`HFEngine`) against transformers' `model.generate`.

    .venv/bin/python bench/generation.py [--presets tiny-3m tiny-10m] [--repeats 7] [--threads 2] [--compile]
                                         [--unpacked] [--one-at-a-time]

Same model object, same prompts (8 chat prompts), same settings: 8 samples per prompt (64 sequences), up to 64
new tokens, temperature 1, no top-k/top-p, in fp32 and in bf16 autocast. `generate` gets
``num_return_sequences=8, do_sample=True`` and the prompts left-padded; the engine gets ``n=8``. Both are
timed side by side, alternating which goes first, and the figures are medians over the repeats (the machine
is shared: single runs are noisy). Tokens counted are the completion tokens actually produced (through the eos
when one is sampled), so padding `generate` adds after an eos is not counted for it. Each run is timed in wall
time and in the process's CPU time (``cpu_*``): on a shared machine wall time also measures the other jobs
(a descheduled run is slow for reasons of its own), while CPU time is what the run itself costs; with
``--threads 1`` it is the work done, with no OpenMP waits in it.

It also measures the engine-vs-trainer logprob gap: the engine's logprobs for its own samples against a
teacher-forced forward pass of the same model, in fp32 and under bf16 autocast (what a trainer computes),
as mean and max absolute difference. ``--train-steps N`` first trains the model N steps on arithmetic chat
samples (a random model's near-uniform distributions understate the gap; a trained model also stops early).

``--compile`` also times the engine with its decode step compiled (``HFEngine(compile=True)``, not the default)
in the same alternation, as ``compiled``: its first (warm-up) generate pays the compile, reported apart as
``compile_cpu_s`` (this process's CPU seconds plus the C++ compiler's), so the timed runs are the steady state.

``--unpacked`` also times the engine with ``prepack_weights=False`` (its linears through `F.linear` rather than
weights prepacked for oneDNN, `posttrain.models.kernels`) in the same alternation, as ``unpacked``.
``--one-at-a-time`` changes the workload on every side to the latency-bound case: each prompt its own call, one
sample (n = 1), one after another (8 calls per run).

Ends with exactly one JSON line: per preset and precision the medians and their ratio, the gaps, and
``"ratio"``: the engine at its fastest precision (bf16 autocast where the CPU has native bf16) over
transformers' `generate` at its fastest, for the first preset, both with their defaults (the engine eager).
Same-precision ratios are in ``results``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import time

import torch

from posttrain.models import build_tiny_model, train_tokenizer
from posttrain.rollout import HFEngine
from posttrain.types import GenerationRequest, SamplingParams

PROMPTS, SAMPLES, NEW_TOKENS = 8, 8, 64


def make_tokenizer():
    rng = random.Random(0)
    corpus = [f"What is {rng.randint(0, 999)} + {rng.randint(0, 999)}? Think step by step." for _ in range(500)]
    corpus += [f"{a} + {b} = {a + b}. The answer is {a + b}." for a, b in ((rng.randint(0, 99), 7) for _ in range(500))]
    return train_tokenizer(corpus, vocab_size=512)


def make_prompts(tokenizer) -> list[list[int]]:
    prompts = []
    for i in range(PROMPTS):
        messages = [{"role": "user", "content": f"What is {17 * i + 3} + {29 * i + 11}?"}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    return prompts


def precision_context(precision: str):
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


ONE_AT_A_TIME = False  # `--one-at-a-time`: each prompt its own call with one sample


def calls(prompts: list[list[int]]) -> tuple[list[list[list[int]]], int]:
    """The prompts as the run's calls, and the samples per prompt."""
    return ([[p] for p in prompts], 1) if ONE_AT_A_TIME else ([prompts], SAMPLES)


def run_engine(engine: HFEngine, prompts: list[list[int]]) -> tuple[int, float, float]:
    """Completion tokens, wall seconds and CPU seconds of one engine run."""
    batches, samples = calls(prompts)
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, n=samples)
    started, cpu = time.perf_counter(), time.process_time()
    groups = [group for batch in batches for group in engine.generate([GenerationRequest(p) for p in batch], sampling)]
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return sum(len(c.token_ids) for group in groups for c in group), seconds, cpu


def run_transformers(model, tokenizer, prompts: list[list[int]], precision: str) -> tuple[int, float, float]:
    batches, samples = calls(prompts)
    started, cpu = time.perf_counter(), time.process_time()
    rows = []
    for prompt_batch in batches:
        batch = tokenizer.pad({"input_ids": prompt_batch}, return_tensors="pt", padding_side="left")
        with torch.inference_mode(), precision_context(precision):
            output = model.generate(
                **batch, do_sample=True, num_return_sequences=samples, max_new_tokens=NEW_TOKENS,
                temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        rows += output[:, batch["input_ids"].shape[1] :].tolist()
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    produced = 0
    for row in rows:  # through the first eos; what follows is padding
        produced += row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
    return produced, seconds, cpu


def train(model, tokenizer, steps: int) -> None:
    """A few hundred SFT steps on arithmetic chats, so the model's distributions look like a real policy's."""
    rng = random.Random(1)
    pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(32 * steps)]
    texts = [
        tokenizer.apply_chat_template(
            [
                {"role": "user", "content": f"What is {a} + {b}?"},
                {"role": "assistant", "content": f"{a} + {b} = {a + b}. The answer is {a + b}."},
            ],
            tokenize=False,
        )
        for a, b in pairs
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        batch = tokenizer(texts[32 * step : 32 * (step + 1)], return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def logprob_gap(engine: HFEngine, model, prompts: list[list[int]]) -> dict:
    """Engine logprobs vs a teacher-forced forward pass of the same weights, in fp32 and bf16 autocast."""
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, n=SAMPLES, seed=0)
    groups = engine.generate([GenerationRequest(p) for p in prompts], sampling)
    gaps: dict[str, list[torch.Tensor]] = {"fp32": [], "bf16": []}
    for prompt, group in zip(prompts, groups):
        for completion in group:
            ids = torch.tensor([prompt + completion.token_ids])
            target = torch.tensor(completion.token_ids)[:, None]
            for trainer, values in gaps.items():
                with torch.inference_mode(), precision_context(trainer):
                    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
                reference = torch.log_softmax(logits, dim=-1).gather(-1, target).squeeze(-1)
                values.append((reference - torch.tensor(completion.logprobs)).abs())
    summary = {}
    for trainer, values in gaps.items():
        joined = torch.cat(values)
        summary[f"vs_trainer_{trainer}"] = {"mean": float(f"{joined.mean():.3g}"), "max": float(f"{joined.max():.3g}")}
    return summary


def children_cpu_s() -> float:
    times = os.times()  # the C++ compiler runs in child processes
    return times.children_user + times.children_system


def bench_preset(preset: str, tokenizer, prompts, precisions: list[str], repeats: int, train_steps: int,
                 compiled: bool, unpacked: bool = False) -> dict:
    model = build_tiny_model(preset, tokenizer, seed=0)
    train(model, tokenizer, train_steps)
    model.eval()
    engines = {p: HFEngine(model, tokenizer, autocast="bfloat16" if p == "bf16" else None) for p in precisions}
    compiled_engines = {p: HFEngine(model, tokenizer, autocast="bfloat16" if p == "bf16" else None, compile=True)
                        for p in (precisions if compiled else [])}
    unpacked_engines = {p: HFEngine(model, tokenizer, autocast="bfloat16" if p == "bf16" else None,
                                    prepack_weights=False) for p in (precisions if unpacked else [])}
    sides = ["engine", "transformers"] + (["compiled"] if compiled else []) + (["unpacked"] if unpacked else [])
    others = {"compiled": compiled_engines, "unpacked": unpacked_engines, "engine": engines}
    rates = {p: {key: [] for side in sides for key in (side, f"cpu_{side}")} for p in precisions}
    compile_cpu_s = {}
    for precision in precisions:  # warm-up: kernel selection, allocator, first-call costs (and the compile)
        run_engine(engines[precision], prompts)
        run_transformers(model, tokenizer, prompts, precision)
        if unpacked:
            run_engine(unpacked_engines[precision], prompts)
        if compiled:
            children = children_cpu_s()
            compile_cpu_s[precision] = run_engine(compiled_engines[precision], prompts)[2] + children_cpu_s() - children
    for repeat in range(repeats):
        for precision in precisions:
            for who in sides if repeat % 2 == 0 else sides[::-1]:
                if who == "transformers":
                    tokens, seconds, cpu = run_transformers(model, tokenizer, prompts, precision)
                else:
                    tokens, seconds, cpu = run_engine(others[who][precision], prompts)
                rates[precision][who].append(tokens / seconds)
                rates[precision][f"cpu_{who}"].append(tokens / cpu)
    result = {}
    for precision, runs in rates.items():
        engine, transformers = statistics.median(runs["engine"]), statistics.median(runs["transformers"])
        result[precision] = {
            "engine_tokens_per_s": round(engine),
            "transformers_tokens_per_s": round(transformers),
            "ratio": round(engine / transformers, 2),
            "cpu_engine_tokens_per_s": round(statistics.median(runs["cpu_engine"])),
            "cpu_transformers_tokens_per_s": round(statistics.median(runs["cpu_transformers"])),
            "cpu_ratio": round(statistics.median(runs["cpu_engine"]) / statistics.median(runs["cpu_transformers"]), 2),
            "runner": engines[precision].runner,
            "logprob_gap": logprob_gap(engines[precision], model, prompts),
        }
        if compiled:
            cpu_compiled = statistics.median(runs["cpu_compiled"])
            result[precision]["compiled"] = {
                "tokens_per_s": round(statistics.median(runs["compiled"])),
                "ratio": round(statistics.median(runs["compiled"]) / transformers, 2),
                "cpu_tokens_per_s": round(cpu_compiled),
                "cpu_ratio": round(cpu_compiled / statistics.median(runs["cpu_transformers"]), 2),
                "compile_cpu_s": round(compile_cpu_s[precision], 1),
                "logprob_gap": logprob_gap(compiled_engines[precision], model, prompts),
            }
        if unpacked:
            cpu_transformers = statistics.median(runs["cpu_transformers"])
            result[precision]["unpacked"] = {
                "tokens_per_s": round(statistics.median(runs["unpacked"])),
                "ratio": round(statistics.median(runs["unpacked"]) / transformers, 2),
                "cpu_ratio": round(statistics.median(runs["cpu_unpacked"]) / cpu_transformers, 2),
                "packed_over_unpacked": round(engine / statistics.median(runs["unpacked"]), 2),
            }
    return result


def headline_ratio(figures: dict) -> float:
    engine = max(f["engine_tokens_per_s"] for f in figures.values())
    transformers = max(f["transformers_tokens_per_s"] for f in figures.values())
    return round(engine / transformers, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny-3m", "tiny-10m"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--train-steps", type=int, default=0, help="train the model first (see above)")
    parser.add_argument("--compile", action="store_true", help="also time the engine's compiled decode step")
    parser.add_argument("--unpacked", action="store_true", help="also time the engine with prepack_weights=False")
    parser.add_argument("--one-at-a-time", action="store_true", help="each prompt its own call, n = 1")
    args = parser.parse_args()
    global ONE_AT_A_TIME
    ONE_AT_A_TIME = args.one_at_a_time
    load_start = os.getloadavg()[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = make_tokenizer()
    prompts = make_prompts(tokenizer)
    results = {}
    for preset in args.presets:
        results[preset] = bench_preset(preset, tokenizer, prompts, args.precisions, args.repeats, args.train_steps,
                                       args.compile, args.unpacked)
        for precision, figures in results[preset].items():
            gap = figures["logprob_gap"]
            print(
                f"{preset:9s} {precision:5s} engine {figures['engine_tokens_per_s']:>7,} tok/s   "
                f"transformers {figures['transformers_tokens_per_s']:>7,} tok/s   ratio {figures['ratio']:.2f} "
                f"(CPU time: {figures['cpu_engine_tokens_per_s']:,} vs {figures['cpu_transformers_tokens_per_s']:,}, "
                f"ratio {figures['cpu_ratio']:.2f})   "
                f"logprob gap vs fp32 trainer {gap['vs_trainer_fp32']}, vs bf16 trainer {gap['vs_trainer_bf16']}"
            )
            if "compiled" in figures:
                c = figures["compiled"]
                print(f"{'':9s} {precision:5s} compiled {c['tokens_per_s']:>7,} tok/s   ratio {c['ratio']:.2f} "
                      f"(CPU time: {c['cpu_tokens_per_s']:,}, ratio {c['cpu_ratio']:.2f}; the compile "
                      f"{c['compile_cpu_s']} CPU-s)   "
                      f"logprob gap vs fp32 trainer {c['logprob_gap']['vs_trainer_fp32']}")
            if "unpacked" in figures:
                u = figures["unpacked"]
                print(f"{'':9s} {precision:5s} unpacked {u['tokens_per_s']:>7,} tok/s   ratio {u['ratio']:.2f} "
                      f"(CPU ratio {u['cpu_ratio']:.2f}); prepacked over unpacked {u['packed_over_unpacked']:.2f}")
    summary = {
        "bench": "generation",
        "sequences": PROMPTS * (1 if ONE_AT_A_TIME else SAMPLES),
        "one_at_a_time": ONE_AT_A_TIME,
        "max_new_tokens": NEW_TOKENS,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "train_steps": args.train_steps,
        "results": results,
        "ratio": headline_ratio(results[args.presets[0]]),
    }
    summary["load_avg_1m"] = [round(load_start, 1), round(os.getloadavg()[0], 1)]  # the machine is shared: load at start and end
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
