"""Long-context SFT: peak memory and tokens/s of posttrain against TRL's SFTTrainer on 8k-token sequences.

    python bench/long_context.py [--length 8192] [--steps 2] [--repeats 2] [--threads N]
                                 [--ours-without-checkpointing]

One model for both: a Llama of hidden 256, 4 layers, 4 heads, MLP 1024 and a 32k vocabulary (so the
``[tokens, vocab]`` logits matter: 1 GiB in fp32 for one 8k sequence), 8k positions, saved once and loaded by
each run. One data set for both: `--steps + 1` sequences of `--length` token ids (seeded, Zipf-distributed
over the vocabulary), loss on every token but the first, batch 1, AdamW, bf16 autocast where the CPU has
native bf16 (`bf16=True` for TRL), fp32 elsewhere.

* posttrain: the SFT step's own pieces (`prepare_model` with `runtime.activation_checkpointing`, `collate`,
  `sft_loss_sum` — the loss in chunks of scored tokens, the head's gradients fused into its forward — and
  `optimizer_step`, as `train.sft._sft_step` runs them), variable-length attention ("auto"; past 1,024 tokens
  a segment runs the fused causal kernel). `--ours-without-checkpointing` adds runs with activation
  checkpointing off (more memory, less recomputation).
* TRL: `SFTTrainer` on the pre-tokenized sequences, its defaults but for what is set to match (batch,
  length, steps, learning rate, bf16, no saving or logging to services).

Every run is a separate process (fair peak RSS: VmHWM of the process, read when it ends, which includes the
interpreter, torch and the libraries each imports); runs alternate (ours, TRL, ours, TRL, ...), and the figures
are medians. Tokens/s is the median step time after the first (warm-up) step. The machine is shared: the
load average is in the JSON.

Ends by printing one JSON line with "memory_ratio" (our peak RSS over TRL's) and "ratio" (our tokens/s over
TRL's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 32000


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return float(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_model_dir(base: Path, length: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.models import train_tokenizer

    tokenizer = train_tokenizer(["a long context benchmark"] * 20, vocab_size=300)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=length,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(base)
    tokenizer.save_pretrained(base)  # a placeholder: both runs read token ids, never text


def make_data(path: Path, count: int, length: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    ranks = np.arange(1, VOCAB - 2)
    weights = 1.0 / ranks
    weights /= weights.sum()
    sequences = [(rng.choice(ranks, size=length, p=weights) + 2).tolist() for _ in range(count)]
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in sequences))


def read_data(path: Path) -> list[list[int]]:
    return [json.loads(line)["input_ids"] for line in path.read_text().splitlines()]


def bf16_available() -> bool:
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def worker_ours(base: Path, data: Path, threads: int, checkpointing: bool = True) -> dict:
    import torch

    from posttrain.config import ModelConfig, OptimConfig, RuntimeConfig
    from posttrain.data import collate
    from posttrain.data.packing import Row
    from posttrain.models import load_model, load_tokenizer
    from posttrain.train import build_optimizer, optimizer_step, prepare_model, setup_runtime, sft_loss_sum

    runtime_config = RuntimeConfig(device="cpu", precision="bf16" if bf16_available() else "fp32",
                                   activation_checkpointing=checkpointing, num_threads=threads)
    model_config = ModelConfig(path=str(base))
    runtime = setup_runtime(runtime_config)
    tokenizer = load_tokenizer(model_config)
    model = prepare_model(load_model(model_config, tokenizer, runtime.device), model_config, runtime_config)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4, weight_decay=0.0, betas=(0.9, 0.999)))
    model.train()
    times, losses = [], []
    for sequence in read_data(data):
        started = time.perf_counter()
        row = Row(sequence, [1] * len(sequence), list(range(len(sequence))), [0] * len(sequence))
        batch = collate([row], pad_id=0)
        with runtime.autocast():
            summed, count = sft_loss_sum(model, batch)
        (summed / count).backward()
        optimizer_step(model, optimizer, None, 1.0)
        times.append(time.perf_counter() - started)
        losses.append(float(summed.detach()) / count)
    return {"step_s": times, "loss": losses, "tokens": len(sequence)}


def worker_trl(base: Path, data: Path, threads: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from sft_throughput import _StepClock as StepClock  # bench/ is on the path of a script run from it

    torch.set_num_threads(threads)
    sequences = read_data(data)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(
            output_dir=out, max_steps=len(sequences), per_device_train_batch_size=1, learning_rate=1e-4,
            lr_scheduler_type="constant", max_length=len(sequences[0]), packing=False, bf16=bf16_available(),
            use_cpu=True, logging_steps=1, report_to="none", save_strategy="no", dataset_num_proc=1, seed=0,
            disable_tqdm=True,
        )
        dataset = Dataset.from_list([{"input_ids": s} for s in sequences])
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                             callbacks=[clock])
        trainer.train()
        losses = [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
        settings = {"gradient_checkpointing": bool(config.gradient_checkpointing),
                    "attn_implementation": model.config._attn_implementation}
    return {"step_s": clock.times, "loss": losses, "tokens": len(sequences[0]), "settings": settings}


def run_worker(kind: str, base: Path, data: Path, threads: int) -> dict:
    """One run in a fresh process; `kind` is "trl", "ours" (activation checkpointing on) or "ours_nockpt"."""
    command = [sys.executable, __file__, "--worker", kind, "--base", str(base), "--data", str(data),
               "--threads", str(threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run (after one warm-up step)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--ours-without-checkpointing", action="store_true",
                        help="also run posttrain with runtime.activation_checkpointing off")
    parser.add_argument("--worker", choices=["ours", "ours_nockpt", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--base", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    threads = args.threads or os.cpu_count() or 1
    if args.worker:
        if args.worker == "trl":
            result = worker_trl(args.base, args.data, threads)
        else:
            result = worker_ours(args.base, args.data, threads, checkpointing=args.worker == "ours")
        result["peak_rss_mb"] = peak_rss_mb()
        print(json.dumps(result))
        return 0

    with tempfile.TemporaryDirectory() as work:
        base, data = Path(work) / "model", Path(work) / "data.jsonl"
        make_model_dir(base, args.length)
        make_data(data, args.steps + 1, args.length)
        kinds = ["ours", "trl"] + (["ours_nockpt"] if args.ours_without_checkpointing else [])
        runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
        for repeat in range(args.repeats):
            order = kinds if repeat % 2 == 0 else kinds[::-1]
            for kind in order:
                runs[kind].append(run_worker(kind, base, data, threads))
                print(f"[long_context] {kind}: {runs[kind][-1]['peak_rss_mb']:.0f} MiB, steps "
                      f"{[round(t, 1) for t in runs[kind][-1]['step_s']]} s", file=sys.stderr)
    figures = {}
    for kind, results in runs.items():
        steady = [statistics.median(r["step_s"][1:] or r["step_s"]) for r in results]
        figures[kind] = {
            "peak_rss_mb": round(statistics.median(r["peak_rss_mb"] for r in results)),
            "tokens_per_s": round(args.length / statistics.median(steady), 1),
            "first_loss": round(results[0]["loss"][0], 4),
        }
    figures["trl"]["settings"] = runs["trl"][0].get("settings", {})
    if "ours_nockpt" in figures:
        variant, trl = figures["ours_nockpt"], figures["trl"]
        variant["memory_ratio"] = round(variant["peak_rss_mb"] / trl["peak_rss_mb"], 3)
        variant["ratio"] = round(variant["tokens_per_s"] / trl["tokens_per_s"], 3)
    print(json.dumps({
        "bench": "long_context",
        "length": args.length, "vocab": VOCAB, "steps": args.steps, "repeats": args.repeats, "threads": threads,
        "precision": "bf16" if bf16_available() else "fp32",
        "results": figures,
        "memory_ratio": round(figures["ours"]["peak_rss_mb"] / figures["trl"]["peak_rss_mb"], 3),
        "ratio": round(figures["ours"]["tokens_per_s"] / figures["trl"]["tokens_per_s"], 3),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
