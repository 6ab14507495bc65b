"""`posttrain demo`: run the demo pipeline (see `posttrain.demo`) from the packaged recipe."""

from __future__ import annotations

import argparse

from posttrain.config import DemoRecipe, load_recipe

QUICK = [  # `--quick`: a few-minute smoke run of every stage (budgets in steps, like the full demo)
    "sft.train.epochs=2",
    "rl.train.max_steps=20",  # and so the continued-SFT control, which matches RL's compute
    "domains.0.demos=2000",
    "domains.0.heldout=100",
]


def main(args: argparse.Namespace) -> int:
    from posttrain.cli import packaged_recipe

    overrides = ([*QUICK] if args.quick else []) + list(args.overrides) + [f"output_dir={args.output}"]
    recipe = load_recipe(packaged_recipe("demo"), overrides, DemoRecipe)
    from posttrain.demo import run_demo

    run_demo(recipe, resume=args.resume)
    return 0
