"""Reaching into a causal LM: its decoder and output head, the attention kernel for a block, dropout off.

Shared by every stage that runs a model's parts separately: the losses apply the head at scored positions only
(`train.forward`), a reward model reads a scalar head on the decoder's hidden states (`models.reward`), and the
preference recipes switch dropout off so the policy at step 0 equals its reference.
"""

from __future__ import annotations

import contextlib

import torch


def split_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder, head) of a Hugging Face causal LM (PEFT-wrapped or not), or None if it does not split."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        decoder, head = base.get_decoder(), base.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or head is None or decoder is base:
        return None
    return decoder, head


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off everywhere (also attention dropout kept as a float on the module)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


# Below this many tokens per row, plain attention (two matmuls and a softmax, Hugging Face's "eager") is the
# fastest on CPU for the right-padded rows of a pair batch: measured for 128 rows of 41 tokens, 4 heads, bf16,
# forward+backward, 31 ms eager vs 140 ms SDPA-math vs 178 ms SDPA-flash (whose backward is slow on CPU);
# and a whole tiny-3m DPO step runs ~15% faster than with the variable-length kernel, which has nothing to
# skip in unpacked rows. For long rows the fused kernels' O(T) memory wins.
EAGER_ATTENTION_MAX_TOKENS_CPU = 256
_SAME_AS_EAGER_ON_CAUSAL_ROWS = ("sdpa", "posttrain_varlen")


@contextlib.contextmanager
def attention_kernel(model: torch.nn.Module, input_ids: torch.Tensor):
    """Within the block, short CPU batches use plain attention; the model's setting is restored after.

    Only over implementations that compute the same thing for unpacked causal rows, and not with activation
    checkpointing: its recomputation in the backward pass runs outside this block and must see the same
    kernel as the forward.
    """
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if (input_ids.device.type != "cpu" or input_ids.shape[1] > EAGER_ATTENTION_MAX_TOKENS_CPU
            or current not in _SAME_AS_EAGER_ON_CAUSAL_ROWS or _activation_checkpointing(model)):
        yield
        return
    config._attn_implementation = "eager"
    try:
        yield
    finally:
        config._attn_implementation = current


def _activation_checkpointing(model: torch.nn.Module) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    flag = getattr(type(base), "is_activation_checkpointing", None)  # transformers >= 5.x; before: gradient_
    return bool(base.is_activation_checkpointing if flag is not None else getattr(base, "is_gradient_checkpointing",
                                                                                  False))
