"""One rank of the context-parallel test (tests/test_context_parallel.py): the loss share and the summed
gradients of one long sequence, written to ``$OUT_DIR/rank<r>.pt``. Run with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set (gloo)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.train import all_reduce_gradients, all_reduce_sum, context_parallel_loss_sum

VOCAB, LENGTH = 97, 203  # a length no multiple of 2 * ranks: the padding is exercised


def build_model() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    model.set_attn_implementation("eager")
    return model


def sequence() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (LENGTH,), generator=generator)
    labels = ids.clone()
    labels[:17] = -100  # an untrained prompt
    labels[120:131] = -100  # and an untrained stretch in the middle
    return ids, labels


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = build_model()
    ids, labels = sequence()
    loss, count = context_parallel_loss_sum(model, ids, labels, chunk_tokens=16)
    total = all_reduce_sum(count)
    (loss / total).backward()
    all_reduce_gradients(model)
    whole_loss = all_reduce_sum(float(loss.detach())) / total
    grads = {name: p.grad for name, p in model.named_parameters()}
    torch.save({"loss": whole_loss, "tokens": total, "local_tokens": count, "grads": grads},
               os.path.join(os.environ["OUT_DIR"], f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
