"""The demo: every stage of posttrain on the built-in tiny model (`posttrain demo`).

Stages register with `@demo_stage(name)`; the recipe's `stages` list picks and orders them.
"""

from posttrain.demo import base as _base  # noqa: F401  (registers "base")
from posttrain.demo import distill as _distill  # noqa: F401  (registers "distill")
from posttrain.demo import dpo as _dpo  # noqa: F401  (registers "dpo")
from posttrain.demo import report as _report  # noqa: F401  (registers "report")
from posttrain.demo import rl as _rl  # noqa: F401  (registers "rl", "sft_control")
from posttrain.demo import sft as _sft  # noqa: F401  (registers "sft")
from posttrain.demo.pipeline import STAGES, DemoRun, demo_stage, print_summary, run_demo
from posttrain.demo.vlm import run_vlm_demo

__all__ = ["STAGES", "DemoRun", "demo_stage", "print_summary", "run_demo", "run_vlm_demo"]
