"""Training building blocks every recipe calls, the losses, and the SFT recipe.

No Trainer base class: `run_sft` (and later `run_dpo`, the RL step) read top to bottom and call these
pieces: `setup_runtime`, `prepare_model`, `build_optimizer`, `build_scheduler`, `optimizer_step`,
the losses, and the checkpoint functions of `posttrain.models`.
"""

from posttrain.train.forward import (
    ForwardParityError,
    check_forward_parity,
    logprob_tolerance,
    selected_logits,
    split_head,
    target_logprobs,
)
from posttrain.train.losses import sft_loss_sum
from posttrain.train.optim import build_optimizer, build_scheduler, lr_factor
from posttrain.train.step import Runtime, optimizer_step, prepare_model, seed_everything, setup_runtime

__all__ = [
    "ForwardParityError",
    "Runtime",
    "build_optimizer",
    "build_scheduler",
    "check_forward_parity",
    "logprob_tolerance",
    "lr_factor",
    "optimizer_step",
    "prepare_model",
    "seed_everything",
    "selected_logits",
    "setup_runtime",
    "sft_loss_sum",
    "split_head",
    "target_logprobs",
]
