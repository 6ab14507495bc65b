"""`posttrain demo [--recipe NAME]`: run a demo from its recipe (a file, or a packaged one by name): the packaged `demo`
by default (the stages of `posttrain.demo`), `--recipe long-context` for the long-context one (docs/long-context.md),
and `--recipe vlm-demo` for SFT then GRPO with the built-in tiny vision-language model (`posttrain.demo.vlm`,
docs/multimodal.md). The recipe's `stage` says which: `demo` or `vlm-demo`."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from posttrain.config import ConfigError, DemoRecipe, VLMDemoRecipe, load_recipe

QUICK = [  # `--quick`: a smoke run of every stage (budgets in steps, like the full demo): ~20 min on 2 cores, fp32
    "sft.train.epochs=2",
    "rl.train.max_steps=20",  # and so the continued-SFT control, which matches RL's compute
    "distill.train.max_steps=20",
    "domains.0.demos=2000",
    "domains.0.heldout=100",
]
# `--quick` for the vlm-demo: the short run of docs/multimodal.md (SFT 200 steps, RL 15; a few minutes on one thread)
VLM_QUICK = ["sft.steps=200", "demos=800", "heldout=200", "rl.steps=15"]


def main(args: argparse.Namespace) -> int:
    from posttrain.cli.stages import recipe_path

    name = getattr(args, "recipe", "demo")
    path = recipe_path(name)
    overrides = list(args.overrides) + ([f"output_dir={args.output}"] if getattr(args, "output", None) else [])
    if _stage(path) == "vlm-demo":
        return _vlm_demo(path, args, overrides)
    quick = [*QUICK] if args.quick and name == "demo" else []
    recipe = load_recipe(path, quick + overrides, DemoRecipe)
    from posttrain.demo import run_demo

    run_demo(recipe, resume=args.resume)
    return 0


def _stage(path: Path) -> str | None:
    """The recipe file's `stage`, or None (a file that does not parse is `load_recipe`'s to report)."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return data.get("stage") if isinstance(data, dict) else None


def _vlm_demo(path: Path, args: argparse.Namespace, overrides: list[str]) -> int:
    if args.resume:
        raise ConfigError(f"{path}: the vlm-demo has no resume (it keeps no checkpoints between its stages): run it "
                          "again, or with --quick for a short run")
    recipe = load_recipe(path, ([*VLM_QUICK] if args.quick else []) + overrides, VLMDemoRecipe)
    from posttrain.demo import run_vlm_demo

    run_vlm_demo(recipe)
    return 0
