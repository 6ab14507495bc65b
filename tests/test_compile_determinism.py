"""A compiled training step is bit-reproducible at more than one thread.

Inductor's C++ code adds an index_put's values (the embedding's backward) with atomics across threads, so two
runs of one compiled SFT drifted apart (docs/demo.md); `compile_decoder` on a CPU model asks for torch's
deterministic lowering, which orders those sums. Each case runs in its own interpreter: the mode is process-wide.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")), reason="torch.compile on CPU needs a C++ compiler")


def run(script: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_compile_decoder_on_cpu_orders_the_accumulations():
    out = run("""
        import torch
        from posttrain.config import ModelConfig
        from posttrain.models import build_tiny_model, train_tokenizer
        from posttrain.train.step import compile_decoder
        tokenizer = train_tokenizer(["a small corpus for a tokenizer: 1 + 2 = 3"] * 20, vocab_size=300)
        model = build_tiny_model("tiny-1m", tokenizer, seed=0)
        before = torch.are_deterministic_algorithms_enabled()
        compile_decoder(model, ModelConfig())
        print(before, torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    """)
    assert out == "False True True"


def test_a_compiled_embedding_backward_repeats_bit_for_bit_at_two_threads():
    # many tokens share a row, so the row's gradient sums many terms: the order shows in the last bits
    out = run("""
        import torch
        from posttrain.train.step import ordered_accumulation
        torch.set_num_threads(2)
        ordered_accumulation()
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(512, 128)
        ids, weights = torch.randint(0, 32, (16, 256)), torch.randn(16, 256, 128)
        step = torch.compile(lambda ids: (embedding(ids) * weights).sum())
        grads = []
        for _ in range(6):
            embedding.weight.grad = None
            step(ids).backward()
            grads.append(embedding.weight.grad.clone())
        print(max((g - grads[0]).abs().max().item() for g in grads))
    """)
    assert float(out) == 0.0
