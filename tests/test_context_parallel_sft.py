"""Context parallelism wired into the sft recipe (`cluster.context_parallel`): packed rows split into zigzag
shares with their sample boundaries kept, the CLI starting 2 gloo ranks that train what one process trains, and
a clear error for what it cannot run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_distributed_sft import losses, run_launcher, weight_gap
from test_sft import data_file, write_recipe  # noqa: F401 - the SFT tests' arithmetic chat data (a module fixture)
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers import MistralConfig, MistralForCausalLM

from posttrain.config import ConfigError, ModelConfig, RLRecipe, RuntimeConfig, SFTRecipe, load_recipe
from posttrain.data import Row, block_causal_mask, collate
from posttrain.distributed import DistributedError, launch_sft
from posttrain.tracking import read_metrics
from posttrain.train import prepare_model, sft_loss_sum
from posttrain.train.context_parallel import (
    ContextParallelError,
    check_context_parallel,
    context_parallel_sft_loss_sum,
    shard_batch,
)
from posttrain.train.sft import run_sft


def packed_rows() -> list[Row]:
    """Two packed rows of several samples each (lengths 5..23), of different widths, with untrained prompts."""
    generator = torch.Generator().manual_seed(3)
    rows = []
    for lengths in ([9, 23, 5, 14], [17, 11, 20]):
        row = Row([], [], [], [])
        for document, length in enumerate(lengths):
            row.input_ids += torch.randint(0, 97, (length,), generator=generator).tolist()
            row.loss_mask += [0] * 3 + [1] * (length - 3)
            row.position_ids += list(range(length))
            row.document_ids += [document] * length
        rows.append(row)
    return rows


def test_shards_partition_every_row_and_keep_its_samples_apart():
    batch = collate(packed_rows(), pad_id=0)
    reference = block_causal_mask(batch["document_ids"], torch.bool)[:, 0]  # [B, T, T]
    width = batch["input_ids"].shape[1]
    real = batch["document_ids"] >= 0
    shards = [shard_batch(batch, rank, 3) for rank in range(3)]
    assert sum(s["num_tokens"] for s in shards) == int(real.sum())
    assert sum(s["trained_tokens"] for s in shards) == int((batch["labels"] != -100).sum())
    padded = shards[0]["visible"].shape[-1]
    assert padded % 6 == 0 and padded >= width
    keys = torch.cat([torch.arange(padded).reshape(6, -1)[[r, 5 - r]].reshape(-1) for r in range(3)])
    for rank, shard in enumerate(shards):
        queries = torch.arange(padded).reshape(6, -1)[[rank, 5 - rank]].reshape(-1)
        for q_index, q in enumerate(queries.tolist()):
            if q >= width or not real[:, q].all():
                continue  # padding: sees itself only, never scored
            for k_index, k in enumerate(keys.tolist()):
                expected = reference[:, q, k] if k < width else torch.zeros(2, dtype=torch.bool)
                assert torch.equal(shard["visible"][:, 0, q_index, k_index], expected)
        # rotary positions stay each sample's own; targets are the next token, shifted before the split
        assert torch.equal(shard["position_ids"][:, queries < width], batch["position_ids"][:, queries[queries < width]])
        inside = queries < width - 1
        assert torch.equal(shard["targets"][:, inside], batch["labels"][:, queries[inside] + 1])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_one_rank_context_parallel_loss_is_the_packed_loss(tmp_path, checkpointing):
    """The split forward (its own mask, attention and head) on packed rows against `sft_loss_sum` with
    variable-length attention, in one gloo process: the layout the ranks compute, without the transfers. With
    activation checkpointing the layers recomputed in the backward must get the split attention back (with the
    model's own attention the samples of a row would see each other, and the gradients would differ)."""
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = prepare_model(LlamaForCausalLM(config), ModelConfig(), RuntimeConfig(activation_checkpointing=checkpointing))
    model.train()
    batch = collate(packed_rows(), pad_id=0)
    expected, count = sft_loss_sum(model, batch)
    expected.backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        shard = shard_batch(batch, 0, 1)
        loss, scored = context_parallel_sft_loss_sum(model, shard, chunk_tokens=16)
        loss.backward()
    finally:
        dist.destroy_process_group()
    assert scored == count
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    for name, parameter in model.named_parameters():
        assert torch.allclose(parameter.grad, reference[name], atol=1e-5, rtol=1e-4), name


def test_models_it_cannot_split_are_named():
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                           sliding_window=8))
    with pytest.raises(ContextParallelError, match="soft-capped attention.*sliding-window"):
        check_context_parallel(gemma, 128)
    mistral = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               sliding_window=64))
    with pytest.raises(ContextParallelError, match="window 64 < rows of 128"):
        check_context_parallel(mistral, 128)
    check_context_parallel(mistral, 64)  # a window as long as the rows cuts nothing


def cp_recipe(directory: Path, data_file: Path, **sections) -> Path:
    """The SFT tests' recipe on packed 256-token rows (several arithmetic samples each), 3 steps of 4 rows."""
    sections = {"data": {"max_length": 256}, "optim": {"schedule": "constant"},
                "train": {"batch_size": 4, "micro_batch_size": 2, "max_steps": 3}, **sections}
    directory.mkdir(parents=True, exist_ok=True)
    return write_recipe(directory, data_file, **sections)


def metric(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run_dir / "metrics.jsonl") if key in r}


def test_what_it_does_not_combine_with_is_refused_up_front(tmp_path, data_file, monkeypatch):
    recipe = cp_recipe(tmp_path, data_file, cluster={"context_parallel": 2, "data_parallel": "fsdp"},
                       model={"lora": {"enabled": True}}, runtime={"compile": True})
    with pytest.raises(ConfigError, match="cluster.context_parallel.*model.lora.*runtime.compile.*fsdp"):
        load_recipe(recipe, schema=SFTRecipe)
    with pytest.raises(ValueError, match="cluster.context_parallel.*sft recipe only"):
        RLRecipe.model_validate({"cluster": {"context_parallel": 2}})
    # Under torchrun the group is the context-parallel group: another size is an error before any rendezvous.
    monkeypatch.setenv("WORLD_SIZE", "4")
    plain = load_recipe(cp_recipe(tmp_path, data_file, cluster={"context_parallel": 2}), schema=SFTRecipe)
    with pytest.raises(DistributedError, match="torchrun started 4 processes"):
        launch_sft(plain)


@pytest.mark.slow  # two spawned ranks importing torch and transformers: ~4 min at load 7-10, ~9 at load ~25
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_cli_with_context_parallel_2_trains_what_one_process_trains(tmp_path, data_file, checkpointing):
    runtime = {"activation_checkpointing": checkpointing}
    single = run_sft(load_recipe(cp_recipe(tmp_path / "single", data_file, runtime=runtime), schema=SFTRecipe))
    split = tmp_path / "split"
    run_launcher([sys.executable, "-m", "posttrain", "sft",
                  str(cp_recipe(split, data_file, cluster={"context_parallel": 2}, runtime=runtime))])

    one, two = losses(single.output_dir), losses(split / "run")
    assert one.keys() == two.keys() == {1, 2, 3}
    assert all(two[step] == pytest.approx(one[step], abs=1e-5) for step in one)
    assert one[3] < one[1]  # it trained
    assert metric(split / "run", "train/tokens") == metric(single.output_dir, "train/tokens")
    heldout = metric(split / "run", "eval/heldout_loss")
    assert heldout and heldout == pytest.approx(metric(single.output_dir, "eval/heldout_loss"), abs=1e-5)
    # The checkpoint is a plain Hugging Face directory holding one process's weights.
    AutoModelForCausalLM.from_pretrained(split / "run" / "final")
    assert weight_gap(split / "run" / "final", single.final_dir) < 1e-4
