"""`python -m posttrain.distributed {rl,sft} recipe.yaml [overrides] [--resume]`: the posttrain command with
its `rl` and `sft` stages routed through `posttrain.distributed` (Ray with ``cluster.backend: ray``; sharded
SFT under torchrun). Everything else is the `posttrain` command."""

from __future__ import annotations

import sys

from posttrain.cli import main, register_stage

register_stage("rl", "RL with verifiable rewards, on this machine or a Ray cluster (cluster.backend)",
               "posttrain.distributed.cli:rl")
register_stage("sft", "supervised fine-tuning, sharded under torchrun or on Ray (cluster.backend)",
               "posttrain.distributed.cli:sft")

if __name__ == "__main__":
    sys.exit(main())
