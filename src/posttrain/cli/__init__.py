"""The `posttrain` command: one subcommand per stage, each running a typed recipe.

    posttrain sft recipe.yaml optim.lr=3e-4 [--resume]
    posttrain validate grpo-math                 # check a recipe, its model and data, without training
    posttrain recipes grpo-math --copy my-run/   # a packaged recipe with its data, to edit
    posttrain demo [--recipe long-context|vlm-demo]

A user's mistake (bad recipe, bad data, missing model) is a one-line error and exit code 2; `--debug`
shows the traceback. Anything else is a bug and always shows one.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Callable

from posttrain.types import PosttrainError

# Stage name -> (help, module:function); modules are imported only when their stage runs, so
# `posttrain --help` is instant.
STAGES: dict[str, tuple[str, str]] = {
    "sft": ("supervised fine-tuning on chat data with metadata", "posttrain.cli.stages:sft"),
    "dpo": ("preference optimization on pairs: DPO, conservative DPO, IPO, SimPO", "posttrain.cli.stages:dpo"),
    "rm": ("a Bradley-Terry reward model on preference pairs", "posttrain.cli.stages:rm"),
    "distill": ("distil a teacher into a smaller student that shares its tokenizer: logit (forward/reverse KL, "
                "JSD), on-policy (GKD) or sequence-level", "posttrain.cli.stages:distill"),
    "rl": ("RL with verifiable rewards: rollouts, verifiers, GRPO-family updates", "posttrain.cli.stages:rl"),
    "eval": ("evaluate checkpoints: held-out, fresh-draw, dataset, regression and safety suites; HTML report",
             "posttrain.cli.stages:evaluate"),
    "data": ("the data flywheel: `data pairs` / `data sft` from verified episodes (a run's episodes.jsonl)",
             "posttrain.cli.stages:data"),
    "demo": ("the whole pipeline on the built-in tiny model (CPU: 17-26 minutes on 2 cores with bf16, by "
             "machine; ~62 in fp32, estimated; --quick ~20)",
             "posttrain.cli.demo:main"),
    "validate": ("check a recipe without training: schema, model and tokenizer, data counts, one rendered "
                 "sample with its loss mask, estimated steps and tokens", "posttrain.cli.validate:main"),
    "recipes": ("list, print or copy (--copy DEST) the packaged example recipes", "posttrain.cli.stages:recipes"),
    "serve": ("an OpenAI-compatible HTTP API on a checkpoint (continuous batching)", "posttrain.cli.serving:serve"),
    "chat": ("an interactive terminal chat with a checkpoint", "posttrain.cli.serving:chat"),
    "export": ("a run's model as plain safetensors: LoRA merged, dtype cast", "posttrain.cli.export:main"),
    "quantize": ("weight-only int8 / int4 quantization of a checkpoint (torchao)", "posttrain.cli.quantize:main"),
}


def register_stage(name: str, help_text: str, target: str) -> None:
    """Add a subcommand: `target` is 'module:function', called with the parsed arguments."""
    STAGES[name] = (help_text, target)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="Post-train causal language models: SFT, preference optimization, RL with verifiable "
        "rewards, agentic RL, evaluation.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors too")
    parser.add_argument("--version", action="version", version=f"posttrain {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="STAGE")
    for name, (help_text, _) in STAGES.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        if name == "demo":
            sub.add_argument("--recipe", default="demo", help="a demo-stage recipe: a file, or a packaged one by name "
                             "(default demo; long-context: docs/long-context.md; vlm-demo: docs/multimodal.md)")
            sub.add_argument("--output", default=None, help="run directory (default: the recipe's output_dir, "
                             "runs/demo for the demo)")
            sub.add_argument("--resume", action="store_true", help="skip finished stages, resume the running one")
            sub.add_argument("--quick", action="store_true", help="a shorter smoke run of every stage (smaller "
                             "budgets): the demo's took ~20 minutes on a 2-core CPU in fp32, less with bf16; the "
                             "vlm-demo's a few minutes")
            sub.add_argument("overrides", nargs="*", help="demo recipe overrides, key.path=value")
        elif name == "data":
            sub.add_argument("action", choices=["pairs", "sft"], help="pairs: preference pairs; sft: SFT samples")
            sub.add_argument("episodes", nargs="+", help="episodes.jsonl files (an RL run writes one)")
            sub.add_argument("--out", required=True, help="output JSONL")
            sub.add_argument("--per-task", type=int, default=2, help="pairs: at most this many per task")
            sub.add_argument("--source", default=None, help="metadata.source (default: the episodes file)")
        elif name == "export":
            from posttrain.cli.export import add_arguments

            add_arguments(sub)
        elif name == "quantize":
            from posttrain.cli.quantize import add_arguments

            add_arguments(sub)
        elif name == "recipes":
            sub.add_argument("name", nargs="?", help="print this recipe (default: list them)")
            sub.add_argument("--copy", metavar="DEST", default=None,
                             help="copy the recipe and the files beside it that it names (data, reward code) into "
                                  "the directory DEST, to edit and run from there")
        elif name == "validate":
            sub.add_argument("recipe", help="recipe YAML or a packaged recipe's name")
            sub.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.max_steps=10")
        elif name in ("serve", "chat"):
            from posttrain.cli.serving import add_arguments

            add_arguments(name, sub)
        else:
            sub.add_argument("recipe", help="recipe YAML (`posttrain recipes` lists packaged ones)")
            sub.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. optim.lr=3e-4")
            sub.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("posttrain")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from posttrain import __version__

        return __version__


def _resolve(target: str) -> Callable[[argparse.Namespace], int | None]:
    import importlib

    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    _quiet_libraries()
    try:
        result = _resolve(STAGES[args.command][1])(args)
    except PosttrainError as error:
        if args.debug:
            raise
        print(f"posttrain {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"posttrain {args.command}: interrupted (checkpoints written so far are kept)", file=sys.stderr)
        return 130
    return int(result or 0)


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # HF_HUB_OFFLINE is the user's to set: a hub id in model.path is fetched when the hub is reachable.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def packaged_recipe(name: str) -> Path:
    """The path of a packaged recipe by name (`grpo-math` or `grpo-math.yaml`)."""
    root = Path(__file__).resolve().parent.parent / "recipes"
    path = root / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in root.glob("*.yaml")))
        raise PosttrainError(f"no packaged recipe '{name}' (known: {known})")
    return path
