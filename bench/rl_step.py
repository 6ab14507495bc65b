"""Full RL steps (generation + verification + update): posttrain's `run_rl` against TRL's GRPOTrainer.

    python bench/rl_step.py [--presets tiny-3m] [--prompts 8] [--group 8] [--max-new 32] [--steps 12] [--repeats 3]
                            [--warm-start-steps 400] [--levels 1 2] [--no-compare-skip] [--no-overlap]
                            [--shared-prefix]

Same model (the built-in tiny Llama, same weights: initialised with seed 0, then `--warm-start-steps` steps of a
seeded SFT on 1-2 digit additions answered directly, once per preset, so that pass rates are mixed -- from the
random model every group fails and every advantage is 0, which posttrain's update skips: its training half would
vanish), same prompts (additions of `--levels` digits, 1 and 2 by default, drawn uniformly on both sides, each group a
fresh problem: `--uniform-prompts`, the default; the scheduler's own priority favours problems with reward
spread, so its batches would hold fewer zero-advantage groups than TRL's), same reward (the
arithmetic domain's exact-answer verifier), same sampling (temperature 1, the same max completion length, 8
completions per prompt), one precision for both (``--precision``: ``auto``, the recipe default, is bf16 autocast
where the CPU has native bf16 and fp32 elsewhere; posttrain gets it as `runtime.precision`, TRL `bf16=True` when it
resolves to bf16), no KL term, one optimizer step
per batch, gradient checkpointing off. posttrain runs its recipe defaults (the synchronous loop,
`max_staleness: 0`, `runtime.compile: auto`, which stays eager for a run as short as this one: it compiles a run
long enough to win the compile back, from a warm cache or cold (`posttrain.models.compile_pays`), whose speed is
the synchronous compiled row), rollouts overlapped one step ahead of training (`max_staleness: 1`, as the demo's
RL stage runs), and both with `runtime.compile` (`--no-compile` skips those); `"ratio"` is posttrain's fastest
configuration over TRL's fastest (TRL runs eagerly and with its `torch_compile`; the SFT bench also takes
TRL's fastest), `"ratio_default"` the recipe defaults' over it on this short run and `"ratio_default_long_run"`
theirs on a run long enough to compile (the synchronous compiled configuration). Figures are steady-state medians over the steps
after `--warmup` (compiling happens there); runs alternate (ours, TRL, ours, ...). `"compile_cpu_s"` is what the
compiled runs' steps took above a steady one, per repeat (the process's CPU, not the C++ compiler's): the first
from whatever posttrain's compile cache held (cold on a fresh machine), the others from the warm cache.

`"ours_no_skip"` is the defaults with `algorithm.skip_zero_advantage` off (TRL trains on zero-advantage completions
too), `"cpu_ratio_default_no_skip"` its CPU ratio; `"zero_adv_fraction"` is each side's share of completions whose
group had no reward spread (posttrain: 1 - `dynamic/signal_share`; TRL: its `frac_reward_zero_std`), a row's
`"skipped_fraction"` the share the update left out, `"pass_rate"` the mean training reward, and the
`--shared-prefix` row's `"shared_prefix_share"` the share of scored tokens the layout scored (0 would mean the run
refused it: its log says why).

samples/s = completions per step / seconds per step; tokens/s counts completion tokens.
Ends by printing one JSON line: {"bench": "rl_step", "results": {...}, "ratio": ours / TRL (samples/s)}.
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


WARM_START_STEPS = 400
# lr of the warm start: at 1e-2 (until 2026-12-04) the model passed 2-4% of the bench's sums whatever the steps;
# at 1e-3, measured on sampled completions (64 prompts x 8, temperature 1): 19% after 200 steps, 28% after 400, 31%
# after 600 -- the mixed pass rates an RL batch has in practice
WARM_START_LR = 1e-3


class _StepClock(TrainerCallback):
    def __init__(self):
        self.times: list[float] = []
        self.cpu_times: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._start, self._start_cpu = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)
        self.cpu_times.append(time.process_time() - self._start_cpu)


def warm_start(preset: str, tokenizer, steps: int, seed: int = 0):
    """The base both sides start from: the tiny model (weights seed 0) after `steps` steps of SFT on 1-2 digit
    additions answered directly (no reasoning trace: short rows, so this costs well under a CPU-minute), which
    teaches the answer format, most one-digit sums and few two-digit ones (~28% of sampled answers pass) -- so an
    RL batch of both levels holds groups that all pass, all fail and mix. From the random model every group fails
    and every advantage is 0. Deterministic: seeded tasks, seeded init, fp32."""
    import torch

    from posttrain.config import OptimConfig
    from posttrain.data import Row, collate, tokenize_samples
    from posttrain.models import build_tiny_model
    from posttrain.tasks import get_domain, sample_tasks
    from posttrain.train import build_optimizer, sft_loss_sum

    torch.manual_seed(seed)
    model = build_tiny_model(preset, tokenizer, seed=0)
    if steps == 0:
        return model
    domain, batch_size = get_domain("arithmetic", operators="+"), 32
    tasks = sample_tasks(domain, steps * batch_size, level=[1, 2], split="train", seed=seed + 1000, unique=False)
    tokenized = tokenize_samples([domain.demonstration(t) for t in tasks], tokenizer, 128, "drop").samples
    rows = [Row(s.input_ids, s.loss_mask, list(range(len(s))), [0] * len(s)) for s in tokenized]
    optimizer = build_optimizer(model, OptimConfig(lr=WARM_START_LR, max_grad_norm=None))
    model.train()
    for step in range(steps):
        batch = collate(rows[step * batch_size : (step + 1) * batch_size], tokenizer.pad_token_id)
        summed, count = sft_loss_sum(model, batch)
        (summed / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.eval()


def run_ours(base: Path, args, staleness: int, threads: int, compile_: bool | str = "auto", skip: bool = True,
             shared_prefix: bool = False) -> dict:
    from posttrain.config.rl import RLRecipe
    from posttrain.rl import run_rl

    with tempfile.TemporaryDirectory() as out:
        recipe = RLRecipe.model_validate({
            "output_dir": out,
            "model": {"path": str(base)},
            "domains": [{"name": "arithmetic", "args": {"operators": "+"}, "levels": args.levels, "heldout": 0}],
            # levels drawn uniformly, as TRL's prompts are (the curriculum would start at the lowest); with
            # --uniform-prompts every group a fresh problem drawn uniformly, as TRL's list is (the scheduler's
            # default favours problems with reward spread and revisits them: fewer zero-advantage groups)
            "schedule": {"curriculum": {"enabled": False},
                         **({"priority": {"weighting": "uniform", "max_visits": 1}} if args.uniform_prompts else {})},
            "rollout": {"prompts_per_step": args.prompts,
                        "sampling": {"group_size": args.group, "max_new_tokens": args.max_new}},
            "algorithm": {"skip_zero_advantage": skip},
            "optim": {"lr": 1e-4, "schedule": "constant"},
            "train": {"max_steps": args.steps + args.warmup, "micro_batch_size": args.prompts * args.group,
                      "shared_prefix": shared_prefix},
            "pipeline": {"max_staleness": staleness, "self_test": False},
            "runtime": {"precision": args.precision, "num_threads": threads, "compile": compile_},
            "tracking": {"tensorboard": False, "progress": False},
        })
        result = run_rl(recipe)
    steady = result.history[args.warmup:]
    seconds = statistics.median(m["time/step_s"] for m in steady)
    cpu = statistics.median(m["time/step_cpu_s"] for m in steady)
    tokens = statistics.mean(m["rollout/policy_tokens"] for m in steady) * args.prompts * args.group
    # what the steps took above a steady one: compiling (cold on a fresh cache, warm after), ~0 eager
    extra_cpu = sum(max(0.0, m["time/step_cpu_s"] - cpu) for m in result.history)
    return {"samples_per_s": args.prompts * args.group / seconds, "tokens_per_s": tokens / seconds,
            "step_s": seconds, "cpu_samples_per_s": args.prompts * args.group / cpu, "step_cpu_s": cpu,
            "first_steps_extra_cpu_s": extra_cpu,
            # every group is one prompt's completions: a group without reward spread is zero advantage throughout
            "zero_adv_fraction": statistics.mean(1.0 - m.get("dynamic/signal_share", 0.0) for m in steady),
            "skipped_fraction": statistics.mean(m.get("train/skipped_zero_adv_sequences", 0.0) for m in steady)
            / (args.prompts * args.group),
            "pass_rate": statistics.mean(m.get("reward/pass_rate", 0.0) for m in steady),
            # with train.shared_prefix: the share of scored tokens the layout scored (0: refused, see the run's log)
            **({"shared_prefix_share": statistics.mean(m.get("train/shared_prefix", 0.0) for m in steady)}
               if shared_prefix else {})}


def run_trl(base: Path, args, threads: int, compile_: bool = False) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.tasks import get_domain, sample_tasks
    from posttrain.verify import verify_exact

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    domain = get_domain("arithmetic", operators="+")
    count = args.prompts * (args.steps + args.warmup)
    tasks = sample_tasks(domain, count, level=args.levels, seed=1)
    dataset = Dataset.from_list([{"prompt": t.messages, "answer": t.verifier_args["answer"]} for t in tasks])

    def exact_reward(completions, answer, **kwargs):
        return [verify_exact(c[0]["content"] if isinstance(c, list) else c, a).score for c, a in zip(completions, answer)]

    lengths: list[int] = []

    def counting_reward(completion_ids=None, **kwargs):  # zero weight: counts completion tokens only
        lengths.extend(len(ids) for ids in completion_ids or [])
        return [0.0] * len(completion_ids or [])

    clock = _StepClock()
    logged: list[dict] = []
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, max_steps=args.steps + args.warmup, per_device_train_batch_size=args.prompts * args.group,
            num_generations=args.group, max_completion_length=args.max_new, temperature=1.0, beta=0.0,
            learning_rate=1e-4, lr_scheduler_type="constant", bf16=args.bf16, use_cpu=True,
            gradient_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no", seed=0,
            reward_weights=[1.0, 0.0], disable_tqdm=True, torch_compile=compile_,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[exact_reward, counting_reward], args=config,
                              train_dataset=dataset, processing_class=tokenizer, callbacks=[clock])
        trainer.train()
        logged = [entry for entry in trainer.state.log_history if "frac_reward_zero_std" in entry]
    seconds = statistics.median(clock.times[args.warmup:])
    cpu = statistics.median(clock.cpu_times[args.warmup:])
    per_step = args.prompts * args.group
    tokens = statistics.mean(lengths[args.warmup * per_step:]) * per_step if lengths else float("nan")
    steady = logged[args.warmup:]  # one log entry per step (logging_steps=1)
    return {"samples_per_s": per_step / seconds, "tokens_per_s": tokens / seconds, "step_s": seconds,
            "cpu_samples_per_s": per_step / cpu, "step_cpu_s": cpu,
            # TRL's share of groups (= of completions) whose rewards have no spread: zero advantage
            "zero_adv_fraction": statistics.mean(e["frac_reward_zero_std"] for e in steady) if steady else float("nan"),
            "pass_rate": statistics.mean(e.get("rewards/exact_reward/mean", float("nan")) for e in steady)
            if steady else float("nan")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny-3m"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                        help="runtime.precision for both sides (auto: the recipe default, bf16 only where it is native)")
    parser.add_argument("--warm-start-steps", type=int, default=WARM_START_STEPS,
                        help="SFT steps on worked additions before RL, for both sides (0: the random model, whose "
                             "groups all fail: every advantage is 0)")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2],
                        help="the arithmetic levels of the RL prompts (digits per operand), drawn uniformly")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                        help="also run posttrain with rollouts one step ahead (max_staleness: 1)")
    parser.add_argument("--compare-skip", action=argparse.BooleanOptionalAction, default=True,
                        help="also run posttrain with algorithm.skip_zero_advantage off ('ours_no_skip')")
    parser.add_argument("--uniform-prompts", action=argparse.BooleanOptionalAction, default=True,
                        help="posttrain draws every group's problem fresh and uniformly, as TRL's prompt list is "
                             "(--no-uniform-prompts: the scheduler's default priority, which favours problems with "
                             "reward spread, so fewer zero-advantage groups than TRL's)")
    parser.add_argument("--shared-prefix", action="store_true",
                        help="also the defaults with train.shared_prefix (a group scored behind one copy of its "
                             "prompt; opt-in), as ours_shared_prefix")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure runtime.compile (posttrain: the trainer's decoder and the engine's decode step "
                             "compiled; TRL: its torch_compile)")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]

    import torch

    from posttrain.config import RuntimeConfig
    from posttrain.models import autocast_dtype, save_model_dir, train_tokenizer
    from posttrain.tasks import get_domain, sample_tasks

    threads = args.threads or torch.get_num_threads()
    args.bf16 = autocast_dtype(RuntimeConfig(precision=args.precision), torch.device("cpu")) == torch.bfloat16
    try:
        import trl  # noqa: F401

        have_trl = True
    except ImportError:
        have_trl = False
        print("TRL is not installed (pip install -e '.[bench]'): measuring posttrain only", file=sys.stderr)
    domain = get_domain("arithmetic", operators="+")
    corpus = []
    for task in sample_tasks(domain, 2000, level=[1, 2, 3], seed=0):
        sample = domain.demonstration(task)
        corpus += [m["content"] for m in sample.messages] + [sample.metadata.reasoning_trace]
    tokenizer = train_tokenizer(corpus, vocab_size=512)
    results: dict = {"threads": threads, "completions_per_step": args.prompts * args.group,
                     "uniform_prompts": args.uniform_prompts,
                     "warm_start_steps": args.warm_start_steps,
                     "precision": f"{args.precision} ({'bf16' if args.bf16 else 'fp32'})"}
    ratios = []
    with tempfile.TemporaryDirectory() as work:
        for preset in args.presets:
            base = Path(work) / preset
            torch.set_num_threads(threads)
            save_model_dir(base, warm_start(preset, tokenizer, args.warm_start_steps), tokenizer)
            runs: dict[str, list[dict]] = {"ours": [], "ours_no_skip": [], "ours_overlap": [], "ours_compiled": [],
                                           "ours_overlap_compiled": [], "ours_shared_prefix": [], "trl": [],
                                           "trl_compiled": []}
            for _ in range(args.repeats):
                runs["ours"].append(run_ours(base, args, 0, threads))
                if have_trl:
                    runs["trl"].append(run_trl(base, args, threads))
                if args.shared_prefix:
                    runs["ours_shared_prefix"].append(run_ours(base, args, 0, threads, shared_prefix=True))
                if args.compare_skip:
                    runs["ours_no_skip"].append(run_ours(base, args, 0, threads, skip=False))
                if args.overlap:
                    runs["ours_overlap"].append(run_ours(base, args, 1, threads))
                if args.compile:
                    runs["ours_compiled"].append(run_ours(base, args, 0, threads, compile_=True))
                    if have_trl:
                        runs["trl_compiled"].append(run_trl(base, args, threads, compile_=True))
                    if args.overlap:
                        runs["ours_overlap_compiled"].append(run_ours(base, args, 1, threads, compile_=True))
            fields = ("samples_per_s", "tokens_per_s", "step_s", "cpu_samples_per_s", "step_cpu_s",
                      "zero_adv_fraction", "skipped_fraction", "pass_rate", "shared_prefix_share")
            entry = {
                key: {field: round(statistics.median(r[field] for r in value), 3) for field in fields if field in value[0]}
                for key, value in runs.items() if value
            }
            if have_trl:
                baselines = {key: value["samples_per_s"] for key, value in entry.items() if key.startswith("trl")}
                entry["baseline"] = max(baselines, key=baselines.get)  # TRL's fastest configuration
                trl_rate = baselines[entry["baseline"]]
                ours = {key: value["samples_per_s"] for key, value in entry.items()
                        if key.startswith("ours") and key != "ours_no_skip"}
                entry["best"] = max(ours, key=ours.get)
                entry["ratio"] = round(ours[entry["best"]] / trl_rate, 3)  # posttrain's fastest configuration
                entry["ratio_default"] = round(ours["ours"] / trl_rate, 3)  # the recipe defaults on this short run: eager
                if "ours_shared_prefix" in ours:  # the defaults plus train.shared_prefix (opt-in)
                    entry["ratio_shared_prefix"] = round(ours["ours_shared_prefix"] / trl_rate, 3)
                # the same by CPU time (the process's, every thread): what a shared machine's wall time blurs
                trl_cpu = max(value["cpu_samples_per_s"] for key, value in entry.items() if key.startswith("trl"))
                entry["cpu_ratio_default"] = round(entry["ours"]["cpu_samples_per_s"] / trl_cpu, 3)
                if "ours_no_skip" in entry:  # the defaults with the zero-advantage skip off: what the skip buys
                    entry["cpu_ratio_default_no_skip"] = round(entry["ours_no_skip"]["cpu_samples_per_s"] / trl_cpu, 3)
                # the share of completions with zero advantage (groups without reward spread), each side's batches
                entry["zero_adv_fraction"] = {key: entry[key]["zero_adv_fraction"] for key in ("ours", "trl")}
                if "ours_compiled" in ours:  # what the defaults run on a run long enough to win the compile back
                    entry["ratio_default_long_run"] = round(ours["ours_compiled"] / trl_rate, 3)
                    entry["cpu_ratio_default_long_run"] = round(entry["ours_compiled"]["cpu_samples_per_s"] / trl_cpu, 3)
                    # per repeat, in order: the first compiles from whatever the cache holds, the rest from a warm one
                    entry["compile_cpu_s"] = [round(r["first_steps_extra_cpu_s"], 1) for r in runs["ours_compiled"]]
                ratios.append(entry["ratio"])
            results[preset] = entry
            print(f"{preset}: {entry}", file=sys.stderr)
    line = {"bench": "rl_step", "results": results}
    if ratios:
        line["ratio"] = min(ratios)
    line["load_avg_1m"] = [round(load_start, 1), round(os.getloadavg()[0], 1)]  # the machine is shared: load at start and end
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
