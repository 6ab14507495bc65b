"""DPO training throughput (pairs/s): posttrain's `run_dpo` against TRL's DPOTrainer, side by side.

    python bench/dpo_throughput.py [--presets tiny-3m] [--pairs 1024] [--batch 32] [--repeats 3] [--threads 1]
    python bench/dpo_throughput.py --trl-eager       # also TRL on a model given plain (eager) attention
    python bench/dpo_throughput.py --write-pairs data/pairs    # arithmetic pairs for the packaged recipes

Same model (the built-in tiny Llama, same initial weights), same pairs (2- and 3-digit sums with their
working, ~32 tokens per sequence), batch and dtype (bf16 autocast for posttrain, `bf16=True` for TRL,
gradient checkpointing off), one epoch each, same loss (sigmoid DPO, beta 0.1) and optimizer settings; the
mean training losses come out equal. The clock covers the training steps and the reference log-probs:
posttrain computes them once before training, TRL (default) with a reference forward in every step, or once
up front with `precompute_ref_log_probs` — both run and the faster is the baseline. TRL's model keeps
transformers' default attention (sdpa); `--trl-eager` adds a TRL run with eager attention, reported
separately. Runs alternate (ours, TRL, TRL-precompute, ours, ...) and the figures are medians, so a shared
machine's noise hits every side alike; CPU seconds (`pairs_per_cpu_s`) are a steadier second opinion with
`--threads 1`.

Ends by printing one JSON line: {"bench": "dpo_throughput", "results": {...}, "ratio": ours / TRL-best}.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def arithmetic_pairs(count: int, *, levels=(2, 3), split: str = "train", seed: int = 0, trace: bool = True,
                     wrong: str = "near") -> list[dict]:
    """Preference records: chosen = the right answer, rejected = a wrong one (after the same working, if any).

    `wrong="near"`: the right answer with one digit changed, or off by one or ten — what a model that has
    half-learnt column addition writes. `wrong="random"`: any other number of the answer's size.
    """
    from posttrain.tasks import get_domain, sample_tasks
    from posttrain.tasks.arithmetic import column_trace

    domain = get_domain("arithmetic", operators="+")
    rng = random.Random(f"pairs:{split}:{seed}")
    records = []
    for task in sample_tasks(domain, count, level=list(levels), split=split, seed=seed):
        meta = task.metadata
        answer = meta["answer"]
        rejected = _near_miss(int(answer), rng) if wrong == "near" else _random_miss(int(answer), rng)
        working = f"<think>{column_trace(meta['a'], meta['b'], meta['op'])}</think>" if trace else ""
        records.append({
            "prompt": task.messages,
            "chosen": {"role": "assistant", "content": working + answer},
            "rejected": {"role": "assistant", "content": working + str(rejected)},
            "metadata": {"domain": "arithmetic", "difficulty": task.difficulty, "source": "generated",
                         "task_id": task.id, "split": split},
        })
    return records


def _near_miss(answer: int, rng: random.Random) -> int:
    while True:
        kind = rng.choice(("digit", "one", "ten"))
        if kind == "digit":
            digits = list(str(answer))
            i = rng.randrange(len(digits))
            digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
            wrong = int("".join(digits))
        else:
            wrong = answer + rng.choice((-1, 1)) * (1 if kind == "one" else 10)
        if wrong >= 0 and wrong != answer:
            return wrong


def _random_miss(answer: int, rng: random.Random) -> int:
    high = 10 ** len(str(answer)) - 1
    while (wrong := rng.randint(0, high)) == answer:
        pass
    return wrong


def write_pairs(directory: Path, train: int = 4000, heldout: int = 400, levels=(2, 3), trace: bool = True) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train), ("heldout", heldout)):
        records = arithmetic_pairs(count, levels=levels, split=split, trace=trace)
        with open(directory / f"{split}.jsonl", "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in records)
    print(f"wrote {train} train and {heldout} held-out pairs to {directory}", file=sys.stderr)


def run_posttrain(preset: str, pairs_file: Path, batch: int, lr: float, output: Path) -> dict:
    """One epoch of `run_dpo`; the clock is the reference pass plus the training loop."""
    from posttrain.config import DPORecipe, load_recipe
    import posttrain.train.dpo as dpo

    recipe = load_recipe(None, [
        f"output_dir={output}", f"model.preset={preset}", f"data.train=[{{path: {pairs_file}}}]", "data.max_length=128",
        f"train.batch_size={batch}", "train.epochs=1", "train.log_every=1000000", f"optim.lr={lr}",
        "optim.schedule=constant", "optim.betas=[0.9, 0.999]", "optim.max_grad_norm=1.0", "dpo.beta=0.1",
        "runtime.precision=bf16", "tracking.tensorboard=false", "tracking.progress=false",
    ], DPORecipe)
    losses: list[float] = []
    clock, reference_clock = _Clock(), _Clock()
    originals = dpo.cached_reference_logprobs, dpo.train_on_pairs
    dpo.cached_reference_logprobs = clock.wrap(reference_clock.wrap(originals[0]))
    dpo.train_on_pairs = clock.wrap(originals[1])
    try:
        result = dpo.run_dpo(recipe, on_step=lambda step, metrics: losses.append(metrics["loss"]))
    finally:
        dpo.cached_reference_logprobs, dpo.train_on_pairs = originals
    # "mean_loss" is the epoch's mean step loss, what TRL reports as its training loss.
    return clock.figures(result.data_report["pairs_kept"]["train"], reference_clock, statistics.fmean(losses))


def run_trl(preset: str, pairs_file: Path, batch: int, lr: float, output: Path, precompute: bool,
            attention: str = "sdpa") -> dict:
    """One epoch of TRL's DPOTrainer on the same model, tokenizer, pairs, batch and dtype."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from posttrain.config import ModelConfig, PreferenceDataConfig
    from posttrain.config import DataSource
    from posttrain.data.preference import load_preference_data, pair_texts
    from posttrain.models import load_model, load_tokenizer

    data = load_preference_data(PreferenceDataConfig(train=[DataSource(path=str(pairs_file))]))
    model_config = ModelConfig(preset=preset)
    tokenizer = load_tokenizer(model_config, corpus=pair_texts(data))  # the tokenizer `run_dpo` builds
    model = load_model(model_config, tokenizer)  # the same initial weights (seeded)
    model.set_attn_implementation(attention)  # transformers' default unless asked otherwise
    dataset = Dataset.from_list([{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected} for p in data.train])
    config = DPOConfig(
        output_dir=str(output), per_device_train_batch_size=batch, num_train_epochs=1, learning_rate=lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=0.1,
        loss_type=["sigmoid"], max_length=128, bf16=True, gradient_checkpointing=False, use_cpu=True,
        precompute_ref_log_probs=precompute, save_strategy="no", report_to=[], logging_steps=10, disable_tqdm=True,
        dataloader_num_workers=0, seed=0,
    )
    clock, reference_clock = _Clock(), _Clock()
    original = DPOTrainer._precompute_ref_logps
    DPOTrainer._precompute_ref_logps = clock.wrap(reference_clock.wrap(original))
    try:
        # An in-memory policy has no path TRL could load the reference from: hand it a copy (TRL's default
        # without precompute keeps that second model and runs it every step).
        reference = None if precompute else copy.deepcopy(model)
        trainer = DPOTrainer(model=model, ref_model=reference, args=config, train_dataset=dataset,
                             processing_class=tokenizer)
    finally:
        DPOTrainer._precompute_ref_logps = original
    with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its logs; stdout is for the JSON line
        output_state = clock.wrap(trainer.train)()
    return clock.figures(len(dataset), reference_clock, output_state.training_loss)


class _Clock:
    """Wall-clock and process CPU seconds spent inside the wrapped calls.

    With one torch thread, CPU seconds do not count the time a busy machine's scheduler takes the core
    away, so they are a steadier second opinion than wall-clock on a shared machine (with more threads they
    include the threads' spin-waiting, and are not)."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def wrap(self, function):
        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - wall
                self.cpu += time.process_time() - cpu

        return timed

    def figures(self, pairs: int, reference: "_Clock", mean_loss: float) -> dict:
        return {"pairs_per_s": pairs / self.wall, "pairs_per_cpu_s": pairs / self.cpu, "seconds": self.wall,
                "reference_seconds": reference.wall, "mean_loss": mean_loss}


def bench_preset(preset: str, pairs_file: Path, args, scratch: Path) -> dict:
    sides = {"posttrain": lambda out: run_posttrain(preset, pairs_file, args.batch, args.lr, out)}
    if not args.no_trl and _have_trl():
        sides["trl"] = lambda out: run_trl(preset, pairs_file, args.batch, args.lr, out, precompute=False)
        sides["trl_precompute"] = lambda out: run_trl(preset, pairs_file, args.batch, args.lr, out, precompute=True)
        if args.trl_eager:
            sides["trl_precompute_eager"] = lambda out: run_trl(preset, pairs_file, args.batch, args.lr, out,
                                                                precompute=True, attention="eager")
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for repeat in range(args.repeats):  # alternate, so a noisy neighbour slows every side alike
        for name, run in sides.items():
            runs[name].append(run(scratch / f"{preset}-{name}-{repeat}"))
            last = runs[name][-1]
            print(f"[{preset}] {name} repeat {repeat}: {last['pairs_per_s']:.1f} pairs/s "
                  f"({last['pairs_per_cpu_s']:.1f} per CPU second)", file=sys.stderr)
    summary = {name: {"pairs_per_s": round(statistics.median(r["pairs_per_s"] for r in results), 1),
                      "pairs_per_cpu_s": round(statistics.median(r["pairs_per_cpu_s"] for r in results), 1),
                      "reference_s": round(statistics.median(r["reference_seconds"] for r in results), 2),
                      "mean_loss": round(statistics.median(r["mean_loss"] for r in results), 4),
                      "repeats": [round(r["pairs_per_s"], 1) for r in results]}
               for name, results in runs.items()}
    # The baseline: TRL as it comes (transformers' default sdpa attention), the faster of its two reference
    # modes. With --trl-eager, the ratio against TRL given plain attention too (a model-loading choice a TRL
    # user can make; on CPU it is what makes the largest difference).
    for baseline, suffix in ((("trl", "trl_precompute"), ""), (("trl_precompute_eager",), "_trl_eager")):
        present = [name for name in baseline if name in summary]
        for figure, key in (("pairs_per_s", "ratio"), ("pairs_per_cpu_s", "ratio_cpu")):
            if present:
                best = max(summary[name][figure] for name in present)
                summary[key + suffix] = round(summary["posttrain"][figure] / best, 2)
    return summary


def _have_trl() -> bool:
    try:
        import trl  # noqa: F401  (only whether it is installed)
    except ImportError:
        print("TRL is not installed (pip install -e '.[bench]'): measuring posttrain only", file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-pairs", type=Path, help="write train/heldout.jsonl arithmetic pairs and exit")
    parser.add_argument("--presets", nargs="+", default=["tiny-1m", "tiny-3m"])
    parser.add_argument("--pairs", type=int, default=1024, help="training pairs (one epoch)")
    parser.add_argument("--batch", type=int, default=32, help="pairs per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no-trl", action="store_true", help="measure posttrain only")
    parser.add_argument("--trl-eager", action="store_true",
                        help="also run TRL (precomputed reference) with eager attention instead of sdpa")
    args = parser.parse_args(argv)
    load_start = os.getloadavg()[0]
    if args.write_pairs:
        write_pairs(args.write_pairs)
        return 0
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    _quiet()
    with tempfile.TemporaryDirectory(prefix="dpo-bench-") as scratch:
        scratch = Path(scratch)
        pairs_file = scratch / "pairs.jsonl"
        pairs_file.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_pairs(args.pairs, levels=(2, 3))))
        results = {preset: bench_preset(preset, pairs_file, args, scratch) for preset in args.presets}
    ratios = [r["ratio"] for r in results.values() if "ratio" in r]
    print(json.dumps({"load_avg_1m": [round(load_start, 1), round(os.getloadavg()[0], 1)],
        "bench": "dpo_throughput", "unit": "pairs/s", "dtype": "bf16", "pairs": args.pairs, "batch": args.batch,
        "threads": torch.get_num_threads(), "results": results, "ratio": min(ratios) if ratios else None,
    }))
    return 0


def _quiet() -> None:
    import logging

    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    logging.disable(logging.WARNING)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


if __name__ == "__main__":
    sys.exit(main())
