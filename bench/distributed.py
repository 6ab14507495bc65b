"""The overhead of going distributed: RL steps/s of the local backend against the Ray backend on one machine.

    .venv/bin/python bench/distributed.py [--preset tiny-3m] [--steps 10] [--rounds 3] [--cores 2]

Same recipe, same model, same total cores (``--cores``): the local backend runs in this process with that many
torch threads; the Ray backend runs ``--cores`` rollout workers and ``--cores`` trainer ranks with one thread
each (``cluster.data_parallel: auto``, which replicates a model this small, and again with ``fsdp``), on a
private Ray instance with ``--cores`` CPUs (the workers and ranks take turns, as the local run's rollout and
training do: ``max_staleness: 0``). Each run takes ``--steps`` RL steps on the arithmetic
domain (8 prompts x 8 samples, up to 32 new tokens); steps/s are measured between the end of step 2 and the end of
the last step (start-up and warm-up left out). Runs alternate local, Ray, local, ... and the figures are medians
over ``--rounds`` (the machine is shared: single runs are noisy).

Ends with one JSON line: the medians, ``"ratio"`` (Ray steps/s over local steps/s, the default
``data_parallel``), ``"overhead"`` (1 - ratio; the goal is under 0.15 on the tiny preset), and the same two for
FSDP-sharded ranks (``"ratio_fsdp"``, ``"overhead_fsdp"``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from posttrain.config.rl import RLRecipe
from posttrain.models import build_tiny_model, save_model_dir, train_tokenizer

WARMUP_STEPS = 2


def make_policy(preset: str, directory: Path) -> Path:
    rng = random.Random(0)
    corpus = [f"What is {rng.randint(0, 999)} + {rng.randint(0, 999)}?" for _ in range(500)]
    corpus += [f"{a} + {b} = {a + b}. The answer is {a + b}." for a, b in
               ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(500))]
    tokenizer = train_tokenizer(corpus, vocab_size=512)
    save_model_dir(directory, build_tiny_model(preset, tokenizer, seed=0), tokenizer)
    return directory


def make_recipe(policy: Path, output: Path, steps: int, cores: int, backend: str,
                data_parallel: str = "auto") -> RLRecipe:
    cluster = {"backend": backend, "num_rollout_workers": cores, "num_trainer_workers": cores,
               "rollout": {"num_cpus": 0.5, "threads": 1}, "trainer": {"num_cpus": 0.5, "threads": 1},
               "data_parallel": data_parallel}
    return RLRecipe.model_validate({
        "output_dir": str(output),
        "model": {"path": str(policy)},
        "domains": [{"name": "arithmetic", "levels": [1], "heldout": 0}],
        "rollout": {"prompts_per_step": 8, "sampling": {"group_size": 8, "max_new_tokens": 32}},
        "train": {"max_steps": steps, "micro_batch_size": 16},
        "pipeline": {"self_test": False, "max_staleness": 0},
        "runtime": {"num_threads": cores},
        "tracking": {"tensorboard": False, "progress": False},
        "cluster": cluster if backend == "ray" else {},
    })


PHASES = ("time/rollout_s", "time/train_s", "time/wait_s", "time/weight_sync_s", "time/weights_gather_s")


def timed_run(recipe: RLRecipe) -> tuple[float, dict[str, float]]:
    """Steps/s between the end of the warm-up steps and the end of the run, and the mean seconds per phase."""
    from posttrain.distributed import launch_rl

    marks: dict[int, float] = {}
    result = launch_rl(recipe, on_step=lambda step, metrics: marks.__setitem__(step, time.perf_counter()))
    last = max(marks)
    measured = result.history[WARMUP_STEPS:]
    phases = {key.removeprefix("time/"): statistics.mean(m.get(key, 0.0) for m in measured) for key in PHASES}
    return (last - WARMUP_STEPS) / (marks[last] - marks[WARMUP_STEPS]), phases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-3m")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    import ray

    root = Path(tempfile.mkdtemp(prefix="posttrain-bench-distributed-"))
    policy = make_policy(args.preset, root / "policy")
    ray.init(num_cpus=args.cores, include_dashboard=False, logging_level="warning")
    runs = {"local": ("local", "auto"), "ray": ("ray", "auto"), "ray_fsdp": ("ray", "fsdp")}
    figures: dict[str, list[float]] = {name: [] for name in runs}
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    try:
        for round_index in range(args.rounds):
            for name, (backend, data_parallel) in runs.items():
                recipe = make_recipe(policy, root / f"{name}-{round_index}", args.steps, args.cores, backend,
                                     data_parallel)
                steps_per_s, seconds = timed_run(recipe)
                figures[name].append(steps_per_s)
                phases[name].append(seconds)
                print(f"round {round_index + 1}: {name} {steps_per_s:.3f} steps/s", file=sys.stderr)
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    local, distributed = statistics.median(figures["local"]), statistics.median(figures["ray"])
    sharded = statistics.median(figures["ray_fsdp"])
    per_phase = {name: {key: round(statistics.median(run[key] for run in measured), 4) for key in measured[0]}
                 for name, measured in phases.items()}
    print(json.dumps({"load_avg_1m": [round(load_start, 1), round(os.getloadavg()[0], 1)],
        "bench": "distributed", "preset": args.preset, "cores": args.cores, "steps": args.steps,
        "local_steps_per_s": round(local, 4), "ray_steps_per_s": round(distributed, 4),
        "ray_fsdp_steps_per_s": round(sharded, 4),
        "runs": {k: [round(v, 4) for v in values] for k, values in figures.items()},
        "seconds_per_step": per_phase,
        "ratio": round(distributed / local, 4), "overhead": round(1 - distributed / local, 4),
        "ratio_fsdp": round(sharded / local, 4), "overhead_fsdp": round(1 - sharded / local, 4),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
