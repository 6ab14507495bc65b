"""Training building blocks every recipe calls, the losses, and the SFT, DPO, reward-model and distillation recipes.

No Trainer base class: `run_sft`, `run_dpo`, `run_rm`, `run_distill` (and the RL recipe in `posttrain.rl`) read top
to bottom and call these pieces: `setup_runtime`, `prepare_model`, `build_optimizer`, `build_scheduler`,
`optimizer_step`, the loop skeleton (`train_loop`, `Cursor`, `StepFigures`), checkpoint save and exact resume
(`save_training`, `find_checkpoint`, `restore_training`), the data-parallel seam (`DataParallel`, `LocalParallel`)
and the losses (distillation's divergences in `train.distill_losses`).
Recipe modules are leaves: what two recipes share lives here (`train.pairs` for DPO and the reward model) or in
`posttrain.models`, never in a recipe.
"""

from posttrain.train.chunked import LOSS_CHUNK_TOKENS, TokenStats, chunked_head_stats, scored_token_stats
from posttrain.train.shared_prefix import (
    MAX_SEQUENCE as SHARED_PREFIX_MAX_SEQUENCE,
    SharedPrefixBatch,
    prompt_end,
    shared_prefix_batch,
    shared_prefix_token_stats,
    shared_prefix_unsupported,
)
from posttrain.train.context_parallel import (
    all_reduce_gradients,
    all_reduce_sum,
    context_parallel_loss_sum,
    zigzag_positions,
)
from posttrain.train.checkpoint import (
    EarlierRunError,
    find_checkpoint,
    open_run_dir,
    restore_training,
    save_training,
    write_checkpoint,
)
from posttrain.train.forward import (
    ForwardParityError,
    check_forward_parity,
    logprob_tolerance,
    selected_logits,
    split_head,
    target_logprobs,
)
from posttrain.train.memory import PeakMemory
from posttrain.train.loop import Cursor, StepFigures, count_items, train_loop
from posttrain.train.losses import sft_loss_sum
from posttrain.train.optim import build_optimizer, build_scheduler, load_optimizer_state, lr_factor
from posttrain.train.parallel import LOCAL, DataParallel, LocalParallel
from posttrain.train.step import (
    Runtime,
    optimizer_step,
    prepare_model,
    resolve_compile,
    seed_everything,
    setup_runtime,
)
from posttrain.train.distill import AnswerSampler, DistillResult, run_distill, teacher_distance
from posttrain.train.distill_losses import forward_kl, generalized_jsd, reverse_kl, token_divergence
from posttrain.train.dpo import run_dpo
from posttrain.train.policy_loss import (
    aggregate,
    clipped_value_loss,
    entropy_from_logits,
    kl_penalty,
    logprob_gap_stats,
    clipped_policy_loss,
    per_token_policy_loss,
    truncated_importance_weights,
)
from posttrain.train.reward_model import run_rm
from posttrain.train.vision import (
    ImageSequence,
    VisionPair,
    completion_logprobs,
    run_vision_dpo,
    run_vision_sft,
    vision_dpo_loss,
    vision_loss_sum,
    vision_sft_loss,
)
from posttrain.train.sft import SFTResult, run_sft

__all__ = [
    "ImageSequence",
    "VisionPair",
    "clipped_policy_loss",
    "completion_logprobs",
    "run_vision_dpo",
    "run_vision_sft",
    "vision_dpo_loss",
    "vision_loss_sum",
    "vision_sft_loss",
    "AnswerSampler",
    "Cursor",
    "DataParallel",
    "DistillResult",
    "EarlierRunError",
    "ForwardParityError",
    "LOCAL",
    "LOSS_CHUNK_TOKENS",
    "LocalParallel",
    "PeakMemory",
    "Runtime",
    "SFTResult",
    "StepFigures",
    "TokenStats",
    "aggregate",
    "all_reduce_gradients",
    "all_reduce_sum",
    "build_optimizer",
    "build_scheduler",
    "check_forward_parity",
    "chunked_head_stats",
    "clipped_value_loss",
    "context_parallel_loss_sum",
    "count_items",
    "entropy_from_logits",
    "find_checkpoint",
    "forward_kl",
    "generalized_jsd",
    "kl_penalty",
    "load_optimizer_state",
    "logprob_gap_stats",
    "logprob_tolerance",
    "lr_factor",
    "open_run_dir",
    "optimizer_step",
    "per_token_policy_loss",
    "prepare_model",
    "resolve_compile",
    "restore_training",
    "reverse_kl",
    "run_distill",
    "run_dpo",
    "run_rm",
    "run_sft",
    "save_training",
    "scored_token_stats",
    "SHARED_PREFIX_MAX_SEQUENCE",
    "SharedPrefixBatch",
    "prompt_end",
    "shared_prefix_batch",
    "shared_prefix_token_stats",
    "shared_prefix_unsupported",
    "seed_everything",
    "selected_logits",
    "setup_runtime",
    "sft_loss_sum",
    "split_head",
    "target_logprobs",
    "teacher_distance",
    "token_divergence",
    "train_loop",
    "truncated_importance_weights",
    "write_checkpoint",
    "zigzag_positions",
]
