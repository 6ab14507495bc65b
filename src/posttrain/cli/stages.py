"""The stage subcommands that run one recipe each (`posttrain sft recipe.yaml ...`)."""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import yaml

from posttrain.config import DPORecipe, RMRecipe, SFTRecipe, load_recipe
from posttrain.tracking import say
from posttrain.types import PosttrainError

_BESIDE = re.compile(r"\$\{recipe_dir\}/([\w./-]+)")  # a file a recipe names beside itself

def recipe_path(name: str) -> Path:
    """A recipe file, or a packaged recipe by name when no such file exists."""
    path = Path(name)
    if path.is_file():
        return path
    from posttrain.cli import packaged_recipe

    return packaged_recipe(name)


def sft(args: argparse.Namespace) -> int:
    # posttrain.distributed runs it in this process unless launched under torchrun or with cluster.backend: ray.
    from posttrain.distributed import launch_sft

    recipe = load_recipe(recipe_path(args.recipe), args.overrides, SFTRecipe)
    result = launch_sft(recipe, resume=args.resume)
    if result is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    say(
        f"[sft] done: {result.steps} steps in {result.seconds:.0f}s ({result.tokens_per_s:,.0f} tokens/s), "
        f"train loss {result.train_loss:.4f}"
        + (f", held-out loss {result.heldout_loss:.4f}" if result.heldout_loss is not None else "")
        + f"\n[sft] model: {result.final_dir}"
    )
    return 0


def dpo(args: argparse.Namespace) -> int:
    from posttrain.tracking import say
    from posttrain.train import run_dpo

    recipe = load_recipe(recipe_path(args.recipe), args.overrides, DPORecipe)
    result = run_dpo(recipe, resume=args.resume)
    say(
        f"[dpo] done: {result.steps} steps in {result.seconds:.0f}s ({result.pairs_per_s:,.1f} pairs/s; reference "
        f"log-probs {result.reference_seconds:.0f}s), train loss {result.train_loss:.4f}"
        + _heldout_line(result.heldout_start, result.heldout, "preference_accuracy", "loss")
        + f"\n[dpo] model: {result.final_dir}"
    )
    return 0


def rm(args: argparse.Namespace) -> int:
    from posttrain.tracking import say
    from posttrain.train import run_rm

    recipe = load_recipe(recipe_path(args.recipe), args.overrides, RMRecipe)
    result = run_rm(recipe, resume=args.resume)
    say(
        f"[rm] done: {result.steps} steps in {result.seconds:.0f}s ({result.pairs_per_s:,.1f} pairs/s), "
        f"train loss {result.train_loss:.4f}" + _heldout_line(result.heldout_start, result.heldout, "accuracy", "loss")
        + f"\n[rm] reward model: {result.final_dir} (an AutoModelForSequenceClassification; score it with "
          "posttrain.models.load_reward_model)"
    )
    return 0


def _heldout_line(start: dict, end: dict, accuracy: str, loss: str) -> str:
    if not end:
        return ""
    return (f", held-out {accuracy.replace('_', ' ')} {start.get(accuracy, float('nan')):.3f} -> {end[accuracy]:.3f}, "
            f"{loss} {start.get(loss, float('nan')):.4f} -> {end[loss]:.4f}")


def distill(args: argparse.Namespace) -> int:
    from posttrain.config import DistillRecipe
    from posttrain.models import autocast_dtype, resolve_device
    from posttrain.rl import EngineAnswerSampler
    from posttrain.train import run_distill

    recipe = load_recipe(recipe_path(args.recipe), args.overrides, DistillRecipe)
    sampler = None
    if recipe.tasks.domains:
        autocast = autocast_dtype(recipe.runtime, resolve_device(recipe.runtime))
        sampler = EngineAnswerSampler(recipe.tasks, seed=recipe.runtime.seed, autocast=autocast)
    result = run_distill(recipe, resume=args.resume, sampler=sampler)
    start, end = result.heldout_start, result.heldout
    say(
        f"[distill] done ({result.mode}): {result.steps} steps in {result.seconds:.0f}s "
        f"({result.tokens_per_s:,.0f} tokens/s), train loss {result.train_loss:.4f}"
        + (f", held-out KL to the teacher {start['eval/kl']:.4f} -> {end['eval/kl']:.4f}, top-1 agreement "
           f"{start['eval/agreement']:.1%} -> {end['eval/agreement']:.1%}" if "eval/kl" in end else "")
        + f"\n[distill] student: {result.final_dir}"
    )
    return 0


def rl(args: argparse.Namespace) -> int:
    from posttrain.config import RLRecipe
    from posttrain.distributed import launch_rl  # local unless cluster.backend: ray

    recipe = load_recipe(recipe_path(args.recipe), args.overrides, RLRecipe)
    result = launch_rl(recipe, resume=args.resume)
    heldout = ", ".join(f"{k} {v:.1%}" for k, v in result.heldout.items())
    say(f"[rl] done: {result.steps} steps in {result.seconds:.0f}s" + (f"; held-out {heldout}" if heldout else ""))
    say(f"[rl] model: {result.final_dir}")
    return 0


def evaluate(args: argparse.Namespace) -> int:
    """`posttrain eval recipe.yaml`: exit code 1 when a regression suite falls below its floor."""
    from posttrain.config import EvalRecipe
    from posttrain.evaluate import evaluate as run_evaluation
    from posttrain.evaluate import print_results
    from posttrain.tracking import say

    recipe = load_recipe(recipe_path(args.recipe), args.overrides, EvalRecipe)
    result = run_evaluation(recipe)
    print_results(result.results)
    say(f"[eval] results: {result.results_path}\n[eval] report: {result.report_path}")
    return 1 if any(row["ok"] is False for row in result.results["regressions"]) else 0


def data(args: argparse.Namespace) -> int:
    from posttrain.data import episodes_to_pairs, episodes_to_sft, read_episodes, write_records
    from posttrain.tracking import say

    episodes = read_episodes(args.episodes)
    source = args.source or ",".join(args.episodes)
    if args.action == "pairs":
        records = episodes_to_pairs(episodes, per_task=args.per_task, source=source)
    else:
        records = episodes_to_sft(episodes, source=source)
    count = write_records(args.out, records)
    say(f"[data] {count} {'preference pairs' if args.action == 'pairs' else 'SFT samples'} from "
        f"{len(episodes)} episodes -> {args.out}")
    return 0


def recipes(args: argparse.Namespace) -> int:
    from posttrain.cli import packaged_recipe

    if args.copy and not args.name:
        raise PosttrainError("recipes --copy: name the recipe to copy (`posttrain recipes grpo-math --copy DEST`)")
    if args.name and args.copy:
        copied = copy_recipe(packaged_recipe(args.name), Path(args.copy))
        say(f"[recipes] copied {', '.join(str(p) for p in copied)}\n[recipes] run it: posttrain "
            f"{_stage_of(copied[0])} {copied[0]}")
        return 0
    if args.name:
        print(packaged_recipe(args.name).read_text(), end="")
        return 0
    root = Path(__file__).resolve().parent.parent / "recipes"
    for path in sorted(root.glob("*.yaml")):
        first = path.read_text().splitlines()[0].lstrip("# ").strip()
        print(f"{path.stem:28s} {first}")
    return 0


def copy_recipe(recipe: Path, destination: Path) -> list[Path]:
    """Copy `recipe` and every file it names as ``${recipe_dir}/...`` into the directory `destination`."""
    if destination.suffix in (".yaml", ".yml") or (destination.exists() and not destination.is_dir()):
        raise PosttrainError(f"recipes --copy: {destination} must be a directory (the recipe's data goes beside it)")
    target = destination / recipe.name
    if target.exists():
        raise PosttrainError(f"recipes --copy: {target} exists already; choose another directory or remove it")
    destination.mkdir(parents=True, exist_ok=True)
    copied = [target]
    shutil.copyfile(recipe, target)
    for relative in sorted(set(_BESIDE.findall(recipe.read_text()))):
        source, out = recipe.parent / relative, destination / relative
        if not source.is_file():
            raise PosttrainError(f"{recipe}: names ${{recipe_dir}}/{relative}, which the package lacks")
        out.parent.mkdir(parents=True, exist_ok=True)
        if not out.exists():
            shutil.copyfile(source, out)
            copied.append(out)
    return copied


def _stage_of(recipe: Path) -> str:
    return str((yaml.safe_load(recipe.read_text()) or {}).get("stage", "<stage>"))
