"""`posttrain demo [--recipe NAME]`: run the demo pipeline (see `posttrain.demo`) from a demo-stage recipe: the
packaged `demo` by default, `--recipe long-context` for the long-context one (docs/long-context.md), or a file."""

from __future__ import annotations

import argparse

from posttrain.config import DemoRecipe, load_recipe

QUICK = [  # `--quick`: a few-minute smoke run of every stage (budgets in steps, like the full demo)
    "sft.train.epochs=2",
    "rl.train.max_steps=20",  # and so the continued-SFT control, which matches RL's compute
    "distill.train.max_steps=20",
    "domains.0.demos=2000",
    "domains.0.heldout=100",
]


def main(args: argparse.Namespace) -> int:
    from posttrain.cli.stages import recipe_path

    name = getattr(args, "recipe", "demo")
    overrides = ([*QUICK] if args.quick and name == "demo" else []) + list(args.overrides)
    if getattr(args, "output", None):
        overrides.append(f"output_dir={args.output}")
    recipe = load_recipe(recipe_path(name), overrides, DemoRecipe)
    from posttrain.demo import run_demo

    run_demo(recipe, resume=args.resume)
    return 0
