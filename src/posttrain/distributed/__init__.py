"""Distributed runs: the same RL and SFT recipes on a Ray cluster, the trainer sharded with torch FSDP.

    from posttrain.distributed import launch_rl, launch_sft
    launch_rl(recipe)   # recipe.cluster.backend: ray -> engine actors, sandbox workers, an FSDP trainer group

    posttrain rl recipe.yaml cluster.backend=ray
    torchrun --nproc_per_node 2 -m posttrain sft recipe.yaml

Nothing below this package imports Ray: the rooms it places (rollout engines, sandboxes, the RL step, the SFT
loop) take a backend or the `train.DataParallel` seam and do not know where they run. Ray itself is imported
only when a Ray run starts, so torchrun launches need no Ray. docs/distributed.md has the cluster set-up.
"""

from posttrain.distributed.errors import DistributedError, PlacementError, TrainerRankError
from posttrain.distributed.parallel import TorchDataParallel
from posttrain.distributed.rl import launch_rl
from posttrain.distributed.sft import launch_sft

__all__ = ["DistributedError", "PlacementError", "TorchDataParallel", "TrainerRankError", "launch_rl", "launch_sft"]
