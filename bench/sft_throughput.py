"""SFT training throughput: posttrain's `run_sft` against TRL's SFTTrainer, side by side, plus model FLOP
utilisation against this machine's measured bf16 matmul peak.

    python bench/sft_throughput.py [--presets tiny-3m] [--samples 6000] [--steps 40] [--repeats 3] [--threads N]

Same model (the built-in tiny Llama, same initial weights), same data (arithmetic chats with their column
working, ~45 tokens each, loss on the assistant reply only), same tokens per optimizer step, same optimizer settings, bf16 (autocast for
posttrain, `bf16=True` for TRL), gradient checkpointing off for both. posttrain packs samples into 128-token
rows (variable-length attention on CPU); TRL runs twice, packed (its BFD packing) and unpacked, and its faster
configuration is the baseline. Tokens/s counts real (non-padding) tokens per second in the steady state (the
median step after `--warmup` steps: posttrain compiles its decoder, ~35 s once, reported as `wall_s`).
Runs alternate (ours, TRL packed, TRL unpacked, ours, ...) and figures are medians: the machine is shared.

Model FLOPs per token (PaLM's accounting): 6 * N + 12 * L * d * T, with N the parameters of the decoder layers
and the output head (the input embedding is a lookup), L layers, d the width and T the mean sample length (each
token attends within its own sample). MFU = model FLOPs/s / the measured bf16 matmul peak (1024^3 GEMMs on the
same threads).

Ends by printing one JSON line: {"bench": "sft_throughput", "results": {...}, "ratio": ours / TRL-best}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import TrainerCallback  # noqa: E402

MAX_LENGTH = 128


def demo_samples(count: int) -> list[dict]:
    from posttrain.tasks import get_domain, sample_tasks

    domain = get_domain("arithmetic", operators="+")
    return [domain.demonstration(t).to_dict() for t in sample_tasks(domain, count, level=[2, 3], seed=0)]


def matmul_peak_gflops(dtype, seconds: float = 2.0) -> float:
    import torch

    a = torch.randn(1024, 1024, dtype=dtype)
    b = torch.randn(1024, 1024, dtype=dtype)
    for _ in range(3):
        a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * 1024**3 * count / (time.perf_counter() - start) / 1e9


def flops_per_token(model, mean_length: float) -> float:
    config = model.config
    embedding = model.get_input_embeddings().weight.numel()
    parameters = sum(p.numel() for p in model.parameters()) - embedding
    return 6 * parameters + 12 * config.num_hidden_layers * config.hidden_size * mean_length


def run_ours(base: Path, data: Path, steps: int, rows_per_step: int, threads: int, warmup: int) -> dict:
    from posttrain.config import SFTRecipe
    from posttrain.tracking import read_metrics
    from posttrain.train.sft import run_sft

    with tempfile.TemporaryDirectory() as out:
        recipe = SFTRecipe.model_validate({
            "output_dir": out,
            "model": {"path": str(base)},
            "data": {"train": [{"path": str(data)}], "max_length": MAX_LENGTH, "pack": True},
            # TRL's defaults (AdamW betas 0.9/0.999, no weight decay), so the losses can be compared.
            "optim": {"lr": 1e-3, "warmup_steps": 5, "weight_decay": 0.0, "betas": [0.9, 0.999]},
            "train": {"batch_size": rows_per_step, "max_steps": steps + warmup, "log_every": 1},
            "runtime": {"precision": "bf16", "num_threads": threads, "compile": True},
            "tracking": {"tensorboard": False, "progress": False},
        })
        started = time.perf_counter()
        run_sft(recipe)
        wall = time.perf_counter() - started
        records = [r for r in read_metrics(Path(out) / "metrics.jsonl") if "train/tokens_per_s" in r]
    per_step = [r["train/tokens_per_s"] for r in records if r["step"] > warmup]
    final_loss = statistics.mean(r["train/loss"] for r in records[-5:])
    return {"tokens_per_s": statistics.median(per_step), "loss": final_loss, "wall_s": wall}


class _StepClock(TrainerCallback):
    """Times every optimizer step of a transformers Trainer (steady state = the steps after warm-up)."""

    def __init__(self):
        self.times: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def run_trl(base: Path, samples: list[dict], steps: int, batch: int, packed: bool, threads: int, warmup: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    records = [{"prompt": s["messages"][:-1],
                "completion": [{"role": "assistant",
                                "content": f"<think>{s['metadata']['reasoning_trace']}</think>"
                                           f"{s['messages'][-1]['content']}"}]} for s in samples]
    clock = _StepClock()
    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(
            output_dir=out, max_steps=steps + warmup, per_device_train_batch_size=batch, learning_rate=1e-3,
            warmup_steps=5, lr_scheduler_type="cosine", max_length=MAX_LENGTH, packing=packed,
            completion_only_loss=True, bf16=True, use_cpu=True, gradient_checkpointing=False,
            logging_steps=1, report_to="none", save_strategy="no", dataset_num_proc=1, seed=0,
            disable_tqdm=True,
        )
        trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(records),
                             processing_class=tokenizer, callbacks=[clock])
        lengths = [len(row["input_ids"]) for row in trainer.train_dataset]
        tokens_per_step = sum(lengths) / len(lengths) * batch  # real tokens: rows are not padded past their length
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        loss = statistics.mean(float(x) for x in losses[-5:])
    return {"tokens_per_s": tokens_per_step / statistics.median(clock.times[warmup:]), "loss": loss}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny-3m"])
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rows", type=int, default=32, help="posttrain: packed 128-token rows per step")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the steady-state figure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]

    import torch

    from posttrain.models import build_tiny_model, save_model_dir, train_tokenizer

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        import trl  # noqa: F401

        have_trl = True
    except ImportError:
        have_trl = False
        print("TRL is not installed (pip install -e '.[bench]'): measuring posttrain only", file=sys.stderr)

    samples = demo_samples(args.samples)
    peak = matmul_peak_gflops(torch.bfloat16)
    results: dict = {"bf16_matmul_peak_gflops": round(peak, 1), "threads": threads}
    ratios = []
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        data = work / "train.jsonl"
        data.write_text("".join(json.dumps(s) + "\n" for s in samples))
        texts = [m["content"] for s in samples for m in s["messages"]] + [s["metadata"]["reasoning_trace"] for s in samples]
        tokenizer = train_tokenizer(texts, vocab_size=512)
        mean_length = statistics.mean(
            len(tokenizer.apply_chat_template(s["messages"], tokenize=True, return_dict=False)) + 20 for s in samples[:500]
        )
        samples_per_row = MAX_LENGTH / mean_length
        for preset in args.presets:
            base = work / preset
            model = build_tiny_model(preset, tokenizer, seed=0)
            save_model_dir(base, model, tokenizer)
            figures: dict[str, list] = {"ours": [], "trl_packed": [], "trl_unpacked": []}
            losses: dict[str, list] = {key: [] for key in figures}
            for _ in range(args.repeats):
                ours = run_ours(base, data, args.steps, args.rows, threads, args.warmup)
                figures["ours"].append(ours["tokens_per_s"])
                losses["ours"].append(ours["loss"])
                if have_trl:
                    for packed, key in ((True, "trl_packed"), (False, "trl_unpacked")):
                        batch = args.rows if packed else max(1, round(args.rows * samples_per_row))
                        trl_run = run_trl(base, samples, args.steps, batch, packed, threads, args.warmup)
                        figures[key].append(trl_run["tokens_per_s"])
                        losses[key].append(trl_run["loss"])
            medians = {key: statistics.median(v) for key, v in figures.items() if v}
            mfu = medians["ours"] * flops_per_token(model, mean_length) / (peak * 1e9)
            entry = {
                "tokens_per_s": {k: round(v) for k, v in medians.items()},
                "final_loss": {k: round(statistics.median(v), 4) for k, v in losses.items() if v},  # last 5 steps
                "mfu_ours": round(mfu, 3),
                "parameters": sum(p.numel() for p in model.parameters()),
            }
            if have_trl:
                best = max(medians["trl_packed"], medians["trl_unpacked"])
                entry["ratio"] = round(medians["ours"] / best, 3)
                ratios.append(entry["ratio"])
            results[preset] = entry
            print(f"{preset}: {entry}", file=sys.stderr)
    line = {"bench": "sft_throughput", "results": results}
    if ratios:
        line["ratio"] = min(ratios)
    line["load_avg_1m"] = [round(load_start, 1), round(os.getloadavg()[0], 1)]  # the machine is shared: load at start and end
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
