"""The `rl` and `sft` stages of `python -m posttrain.distributed` (same arguments and output as `posttrain`)."""

from __future__ import annotations

import argparse

from posttrain.config import SFTRecipe, load_recipe
from posttrain.config.rl import RLRecipe


def rl(args: argparse.Namespace) -> int:
    from posttrain.cli.stages import recipe_path
    from posttrain.distributed.rl import run_rl
    from posttrain.tracking import say

    recipe = load_recipe(recipe_path(args.recipe), args.overrides, RLRecipe)
    result = run_rl(recipe, resume=args.resume)
    heldout = ", ".join(f"{k} {v:.1%}" for k, v in result.heldout.items())
    say(f"[rl] done: {result.steps} steps in {result.seconds:.0f}s" + (f"; held-out {heldout}" if heldout else ""))
    say(f"[rl] model: {result.final_dir}")
    return 0


def sft(args: argparse.Namespace) -> int:
    from posttrain.cli.stages import recipe_path
    from posttrain.distributed.sft import run_sft
    from posttrain.tracking import say

    recipe = load_recipe(recipe_path(args.recipe), args.overrides, SFTRecipe)
    result = run_sft(recipe, resume=args.resume)
    if result is not None:  # rank 0 (or a one-process run) reports
        say(f"[sft] done: {result.steps} steps in {result.seconds:.0f}s ({result.tokens_per_s:,.0f} tokens/s), "
            f"train loss {result.train_loss:.4f}")
        say(f"[sft] model: {result.final_dir}")
    return 0
