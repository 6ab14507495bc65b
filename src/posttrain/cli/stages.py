"""The stage subcommands that run one recipe each (`posttrain sft recipe.yaml ...`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from posttrain.config import SFTRecipe, load_recipe
from posttrain.tracking import console


def recipe_path(name: str) -> Path:
    """A recipe file, or a packaged recipe by name when no such file exists."""
    path = Path(name)
    if path.is_file():
        return path
    from posttrain.cli import packaged_recipe

    return packaged_recipe(name)


def sft(args: argparse.Namespace) -> int:
    from posttrain.train.sft import run_sft

    recipe = load_recipe(recipe_path(args.recipe), args.overrides, SFTRecipe)
    result = run_sft(recipe, resume=args.resume)
    console.print(
        f"[sft] done: {result.steps} steps in {result.seconds:.0f}s ({result.tokens_per_s:,.0f} tokens/s), "
        f"train loss {result.train_loss:.4f}"
        + (f", held-out loss {result.heldout_loss:.4f}" if result.heldout_loss is not None else "")
        + f"\n[sft] model: {result.final_dir}"
    )
    return 0


def recipes(args: argparse.Namespace) -> int:
    from posttrain.cli import packaged_recipe

    if args.name:
        print(packaged_recipe(args.name).read_text(), end="")
        return 0
    root = Path(__file__).resolve().parent.parent / "recipes"
    for path in sorted(root.glob("*.yaml")):
        first = path.read_text().splitlines()[0].lstrip("# ").strip()
        print(f"{path.stem:28s} {first}")
    return 0
