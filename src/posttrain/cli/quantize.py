"""`posttrain quantize CHECKPOINT --to int8|int4 [--out DIR]`: weight-only quantization (see `models.quantize`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from posttrain.tracking import say


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a model directory, a checkpoint, a run directory (its final/) or a LoRA "
                                           "adapter (merged first)")
    parser.add_argument("--to", required=True, help="int8 (per-row int8 weights) or int4 (per-group int4 weights)")
    parser.add_argument("--out", default=None, help="the directory to write (an earlier model directory there is "
                                                    "replaced, one holding anything else refused; default: "
                                                    "CHECKPOINT-int8 / CHECKPOINT-int4 beside it)")
    parser.add_argument("--group-size", type=int, default=32,
                        help="int4: input columns sharing one scale (default 32; must divide the layer widths)")


def main(args: argparse.Namespace) -> int:
    from posttrain.models import quantize_checkpoint

    source = Path(args.checkpoint)
    destination = Path(args.out) if args.out else source.with_name(f"{source.resolve().name}-{args.to}")
    written = quantize_checkpoint(source, destination, to=args.to, group_size=args.group_size)
    say(f"[quantize] {source} -> {written} ({args.to}, torchao; load it with torchao installed)")
    return 0
