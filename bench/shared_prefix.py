"""One RL update with `train.shared_prefix` against the padded layout, on batches shaped like the demo's code RL.

    python bench/shared_prefix.py [--preset tiny-3m] [--groups 16] [--group 8] [--repeats 6] [--threads 2]
                                  [--attention auto] [--kl-coef 0]

`--groups` prompts of 71-112 tokens, each with `--group` continuations of 20-60 (random tokens, seed 0; the
update's cost depends on the shapes, not on what the tokens say), advantages drawn from {1, -1, 0.5}, bf16
autocast where the CPU has native bf16 (`precision: auto`), one micro-batch of 64 sequences at a time, an SGD
optimizer at lr 0 (the weights stay put, so every repeat runs the same update), the attention a recipe's
``model.attn_implementation`` would give (``--attention``; ``auto`` is posttrain's variable-length kernel on a CPU,
which runs the shared layout's 4D mask through its dense path); ``--kl-coef`` above 0 adds the KL term against a
frozen copy of the model (the reference scores the update's layout too). The two layouts alternate; the
figures are the process's CPU seconds per update, medians over the repeats after the first. Ends by printing one
JSON line: {"bench": "shared_prefix", ..., "ratio": padded / shared}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from posttrain.config import RuntimeConfig
from posttrain.config.rl import PolicyLossConfig, RLRecipe
from posttrain.models import autocast_dtype, build_tiny_model, set_attention, train_tokenizer
from posttrain.rl.update import UpdateSettings, make_reference, rl_update
from posttrain.train import Runtime
from posttrain.types import Reward, Trajectory


def batch(groups: int, group: int, vocab: int, seed: int = 0) -> tuple[list[Trajectory], list[float]]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randrange(71, 113))]
        for _ in range(group):
            tail = [rng.randrange(10, vocab) for _ in range(rng.randrange(20, 61))]
            ids = prompt + tail
            out.append(Trajectory(task_id=f"t{g}", domain="bench", token_ids=ids,
                                  loss_mask=[0] * len(prompt) + [1] * len(tail), behaviour_logprobs=[-5.0] * len(ids),
                                  policy_versions=[0] * len(ids), prompt_length=len(prompt),
                                  reward=Reward(score=0.0, passed=False), group_id=str(g)))
    return out, [rng.choice([1.0, -1.0, 0.5]) for _ in out]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-3m")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--attention", default="auto", help="model.attn_implementation: auto, sdpa, eager")
    parser.add_argument("--kl-coef", type=float, default=0.0, help="algorithm.kl_coef (0: no reference forward)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = train_tokenizer(["some text to train a tokenizer on " * 50, "def f(x): return x + 1"], vocab_size=300)
    model = build_tiny_model(args.preset, tokenizer, seed=0)
    set_attention(model, args.attention, torch.device("cpu"))  # as `load_model` does for a recipe
    trajectories, advantages = batch(args.groups, args.group, 290)
    autocast = autocast_dtype(RuntimeConfig(precision="auto"), torch.device("cpu"))
    runtime = Runtime(torch.device("cpu"), autocast)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    reference = None
    if args.kl_coef:
        recipe = RLRecipe.model_validate({"algorithm": {"kl_coef": args.kl_coef}})
        reference = make_reference(model, recipe, runtime)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    load = [round(os.getloadavg()[0], 1)]
    for _ in range(args.repeats):
        for shared in (False, True):
            settings = UpdateSettings(loss=PolicyLossConfig(kl_coef=args.kl_coef), runtime=runtime, pad_id=0,
                                      temperature=1.0, micro_batch_size=64, max_grad_norm=1.0, shared_prefix=shared)
            started = time.process_time()
            rl_update(model, optimizer, None, trajectories, advantages, settings, reference=reference)
            seconds[shared].append(time.process_time() - started)
    load.append(round(os.getloadavg()[0], 1))
    padded, shared = (statistics.median(seconds[key][1:]) for key in (False, True))
    print(f"padded {padded:.3f} CPU-s an update, shared prefix {shared:.3f}: {padded / shared:.2f}x")
    print(json.dumps({"bench": "shared_prefix", "preset": args.preset, "sequences": len(trajectories),
                      "precision": str(autocast or torch.float32).removeprefix("torch."), "threads": args.threads,
                      "attention": model.config._attn_implementation, "kl_coef": args.kl_coef,
                      "padded_cpu_s": round(padded, 3), "shared_cpu_s": round(shared, 3),
                      "ratio": round(padded / shared, 2), "load_avg_1m": load}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
