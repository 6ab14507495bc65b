"""Distillation, measured: a tiny-3m teacher into a fresh tiny-1m student, every mode side by side with plain SFT.

    python bench/distill.py                                   # ~5 min on 2 loaded CPU cores
    python bench/distill.py --teacher-steps 300 --steps 200   # longer

1. Teacher: tiny-3m, SFT on `--demos` one- and two-digit addition demonstrations (with the column trace) for
   `--teacher-steps` steps.
2. Students, each a fresh tiny-1m on the teacher's tokenizer (same seed, same steps, same learning rate):
   ``sft`` (the baseline: cross-entropy on the same demonstrations), ``logit`` (forward KL to the teacher on
   those demonstrations), ``on_policy`` (GKD: JSD(0.5) on the student's own samples, half of each batch from
   the demonstrations) and ``sequence`` (SFT on the teacher's verified answers to `--prompts` task prompts).
3. Each model: greedy pass rate on `--heldout` held-out two-digit tasks (the task's verifier); each student's
   forward KL to the teacher and top-1 agreement on the same rows for all (the teacher's sampled answers to
   `--heldout` held-out prompts, `train.teacher_distance`); greedy decode tokens/s (one batch of the held-out
   prompts, median of `--repeats`, the models alternating).

One JSON line at the end: per model its accuracy, parameters and tokens/s; ``ratio`` is the on-policy student's
decode tokens/s over the teacher's; ``accuracy_delta`` the on-policy student's accuracy minus the teacher's.
The machine is shared: the load average is in the JSON.
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

import torch

from posttrain.config import DistillRecipe, DistillTasksConfig, ModelConfig, SFTRecipe
from posttrain.data import Row, prompt_ids
from posttrain.models import count_parameters, load_model, load_tokenizer
from posttrain.rl import EngineAnswerSampler
from posttrain.rollout import HFEngine
from posttrain.tasks import get_domain, sample_tasks
from posttrain.train import Runtime, run_distill, run_sft, teacher_distance
from posttrain.types import GenerationRequest, SamplingParams

DOMAIN = {"name": "arithmetic", "args": {"operators": "+"}, "levels": [1, 2]}
COMMON = {"runtime": {"precision": "fp32", "num_threads": 1, "seed": 0},
          "tracking": {"tensorboard": False, "progress": False}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demos", type=int, default=2000)
    parser.add_argument("--teacher-steps", type=int, default=150)
    parser.add_argument("--teacher-lr", type=float, default=3e-3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--heldout", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["sft", "logit", "on_policy", "sequence"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="posttrain-bench-distill-"))
    demos = write_demos(root / "demos.jsonl", args.demos)
    data = {"train": [{"path": str(demos)}], "max_length": 96}

    started = time.perf_counter()
    teacher = run_sft(SFTRecipe.model_validate({
        **COMMON, "output_dir": str(root / "teacher"), "model": {"preset": "tiny-3m"}, "data": data,
        "optim": {"lr": args.teacher_lr, "warmup_steps": 10},
        "train": {"batch_size": 32, "max_steps": args.teacher_steps, "log_every": 50}})).final_dir
    timings = {"teacher_sft_s": round(time.perf_counter() - started, 1)}
    models = {"teacher": teacher}
    tasks = {"domains": [DOMAIN], "prompts": args.prompts, "samples_per_prompt": 2, "max_new_tokens": 48}
    student = {"optim": {"lr": 3e-3, "warmup_steps": 10}, "data": data, "tasks": tasks,
               "train": {"batch_size": 32, "max_steps": args.steps, "log_every": 25}}
    for mode in args.modes:
        started = time.perf_counter()
        if mode == "sft":
            models[mode] = run_sft(SFTRecipe.model_validate({
                **COMMON, "output_dir": str(root / mode),
                "model": {"preset": "tiny-1m", "tokenizer_path": str(teacher)},
                "data": data, "optim": student["optim"], "train": student["train"]})).final_dir
        else:
            recipe = DistillRecipe.model_validate({
                **COMMON, **student, "output_dir": str(root / mode), "mode": mode, "teacher": {"path": str(teacher)},
                "data": data if mode in ("logit", "on_policy") else {"max_length": 96},
                "tasks": tasks if mode != "logit" else {},
                "distill": {"loss": "jsd", "data_fraction": 0.5} if mode == "on_policy" else {}})
            models[mode] = run_distill(recipe, sampler=EngineAnswerSampler(recipe.tasks, seed=0)).final_dir
        timings[f"{mode}_s"] = round(time.perf_counter() - started, 1)

    figures = {name: {"accuracy": accuracy(path, args.heldout), "parameters": parameters(path)}
               for name, path in models.items()}
    speeds = decode_speeds(models, args.heldout, args.repeats)
    for name in models:
        figures[name]["decode_tokens_per_s"] = speeds[name]
    for name, distance in distances_to_teacher(models, args.heldout).items():
        figures[name].update(distance)
    best = "on_policy" if "on_policy" in figures else args.modes[-1]
    print(json.dumps({
        "bench": "distill", "models": figures, "timings_s": timings, "steps": args.steps,
        "teacher_steps": args.teacher_steps, "demos": args.demos, "heldout": args.heldout, "seed": 0,
        "ratio": round(figures[best]["decode_tokens_per_s"] / max(figures["teacher"]["decode_tokens_per_s"], 1), 3),
        "accuracy_delta": round(figures[best]["accuracy"] - figures["teacher"]["accuracy"], 4),
        "loadavg": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(), "torch_threads": 1,
    }))


def write_demos(path: Path, count: int) -> Path:
    domain = get_domain(DOMAIN["name"], **DOMAIN["args"])
    with open(path, "w") as handle:
        for task in sample_tasks(domain, count, level=DOMAIN["levels"], seed=0):
            handle.write(json.dumps(domain.demonstration(task).to_dict()) + "\n")
    return path


def _model(path: Path):
    config = ModelConfig(path=str(path))
    tokenizer = load_tokenizer(config)
    return load_model(config, tokenizer), tokenizer


def accuracy(path: Path, count: int) -> float:
    """Greedy pass rate on held-out two-digit sums, judged by the task's verifier."""
    model, tokenizer = _model(path)
    sampler = EngineAnswerSampler(DistillTasksConfig(domains=[{**DOMAIN, "levels": [2]}], temperature=0.0,
                                                     max_new_tokens=48), seed=1)
    answers = sampler(model, tokenizer, role="teacher", count=count, draw=0, split="heldout")
    return round(sum(a.reward.passed for a in answers) / len(answers), 4)


def distances_to_teacher(models: dict[str, Path], count: int) -> dict[str, dict[str, float]]:
    """Every student's (and, as a check, the teacher's own: 0 and 1) forward KL and top-1 agreement to the teacher
    on the teacher's sampled answers to held-out prompts, the same rows for every model."""
    teacher, tokenizer = _model(models["teacher"])
    sampler = EngineAnswerSampler(DistillTasksConfig(domains=[{**DOMAIN, "levels": [2]}], max_new_tokens=48), seed=2)
    answers = sampler(teacher, tokenizer, role="teacher", count=count, draw=0, split="heldout")
    rows = [Row(input_ids=t.token_ids, loss_mask=t.loss_mask, position_ids=list(range(len(t.token_ids))),
                document_ids=[0] * len(t.token_ids)) for t in answers]
    runtime = Runtime(device=torch.device("cpu"), autocast_dtype=None)
    distances = {}
    for name, path in models.items():
        student = _model(path)[0]
        measured = teacher_distance(student, teacher, rows, tokenizer.pad_token_id, runtime, 32, len(tokenizer))
        distances[name] = {"kl_to_teacher": round(measured["eval/kl"], 4),
                           "agreement": round(measured["eval/agreement"], 4)}
    return distances


def parameters(path: Path) -> int:
    return count_parameters(_model(path)[0])


def decode_speeds(models: dict[str, Path], count: int, repeats: int) -> dict[str, int]:
    """Median greedy decode tokens/s per model, the models alternating within each repeat."""
    domain = get_domain(DOMAIN["name"], **DOMAIN["args"])
    heldout = sample_tasks(domain, count, level=[2], split="heldout", seed=1)
    engines = {}
    for name, path in models.items():
        model, tokenizer = _model(path)
        engines[name] = (HFEngine(model, tokenizer, max_batch_size=count),
                         [GenerationRequest(ids) for ids in prompt_ids(tokenizer, [t.messages for t in heldout])])
    sampling = SamplingParams(max_new_tokens=48, temperature=0.0)
    rates: dict[str, list[float]] = {name: [] for name in models}
    for name, (engine, requests) in engines.items():
        engine.generate(requests[:4], sampling)  # warm-up
    for _ in range(repeats):
        for name, (engine, requests) in engines.items():
            started = time.perf_counter()
            completions = engine.generate(requests, sampling)
            seconds = time.perf_counter() - started
            rates[name].append(sum(len(c.token_ids) for group in completions for c in group) / seconds)
    return {name: round(statistics.median(values)) for name, values in rates.items()}


if __name__ == "__main__":
    sys.exit(main())
