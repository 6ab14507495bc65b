"""`posttrain export RUN_DIR DEST [--dtype bfloat16]`: a run's model as plain safetensors (see `models.export`)."""

from __future__ import annotations

import argparse

from posttrain.tracking import say


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (its final/ or newest checkpoint), a checkpoint, a LoRA "
                                        "adapter or a model directory")
    parser.add_argument("dest", help="the directory to write (an earlier model directory there is replaced; "
                                     "a directory holding anything else is refused)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="cast the weights (default: keep the saved dtype)")


def main(args: argparse.Namespace) -> int:
    from posttrain.models import export_model

    destination = export_model(args.run_dir, args.dest, dtype=args.dtype)
    say(f"[export] {args.run_dir} -> {destination}" + (f" ({args.dtype})" if args.dtype else ""))
    return 0
