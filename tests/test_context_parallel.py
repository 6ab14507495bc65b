"""Context parallelism on 2 CPU ranks (gloo): one sequence split over the ranks gives the loss and the gradients
one process computes on the whole sequence (`posttrain.train.context_parallel`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from context_parallel_worker import build_model, sequence

from posttrain.train import sft_loss_sum, zigzag_positions


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_zigzag_gives_every_position_to_one_rank_and_balances_the_work():
    owned = [zigzag_positions(16, rank, 2) for rank in range(2)]
    assert sorted(torch.cat(owned).tolist()) == list(range(16))
    work = [int((positions + 1).sum()) for positions in owned]  # causal keys seen per rank
    assert work[0] == work[1]
    with pytest.raises(ValueError):
        zigzag_positions(10, 0, 2)


@pytest.mark.slow  # two fresh processes importing transformers: ~15 s idle, minutes on a loaded machine
def test_two_ranks_give_the_single_process_loss_and_gradients(tmp_path):
    port = free_port()
    worker = Path(__file__).with_name("context_parallel_worker.py")
    source = Path(__file__).resolve().parents[1] / "src"
    processes = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OUT_DIR": str(tmp_path), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(source), str(worker.parent), os.environ.get("PYTHONPATH", "")])}
        processes.append(subprocess.Popen([sys.executable, str(worker)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    for process in processes:
        output, _ = process.communicate(timeout=240)
        assert process.returncode == 0, output[-3000:]

    model = build_model()
    ids, labels = sequence()
    batch = {"input_ids": ids[None], "labels": labels[None], "position_ids": torch.arange(ids.numel())[None],
             "cu_seq_lens": torch.tensor([0, ids.numel()], dtype=torch.int32)}
    summed, count = sft_loss_sum(model, batch)
    (summed / count).backward()
    expected = {name: p.grad for name, p in model.named_parameters()}

    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == count
    assert 0 < ranks[0]["local_tokens"] < count  # each rank scored only its share
    for result in ranks:
        assert abs(result["loss"] - float(summed.detach()) / count) < 1e-5
        for name, grad in expected.items():
            gap = float((result["grads"][name] - grad).abs().max())
            assert gap <= 1e-5 * max(1.0, float(grad.abs().max())), name
