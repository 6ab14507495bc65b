"""`posttrain export`: a LoRA adapter merged into its base, dtype cast, a reward model exported whole."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from posttrain.cli import main as cli_main
from posttrain.config import LoraConfig
from posttrain.models import (
    ModelError,
    ScalarRewardModel,
    apply_lora,
    build_tiny_model,
    load_reward_model,
    merged_copy,
    save_model_dir,
    save_reward_model,
)
from posttrain.models.export import export_model
from posttrain.models.reward import STATS_FILE


def save_trained_adapter(base, base_dir, tokenizer, directory):
    """A LoRA adapter on `base` (saved at `base_dir`) with random B matrices, so that it changes the model, saved
    with the tokenizer at `directory`; returns the PEFT model."""
    model = apply_lora(copy.deepcopy(base), LoraConfig(enabled=True, r=4))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    model.peft_config["default"].base_model_name_or_path = str(base_dir)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


def test_an_adapter_is_merged_into_its_local_base(tmp_path, tiny_tokenizer):
    base = build_tiny_model("tiny-1m", tiny_tokenizer, seed=1)
    base_dir = save_model_dir(tmp_path / "base", base, tiny_tokenizer)
    model = save_trained_adapter(base, base_dir, tiny_tokenizer, tmp_path / "adapter")

    assert cli_main(["export", str(tmp_path / "adapter"), str(tmp_path / "out")]) == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    expected = merged_copy(model).state_dict()
    assert set(exported) <= set(expected)
    for key, tensor in exported.items():
        torch.testing.assert_close(tensor, expected[key], rtol=0, atol=1e-6)
    assert any(not torch.equal(exported[k], base.state_dict()[k]) for k in exported)


def test_a_reward_model_exports_whole_with_its_statistics(tmp_path, tiny_tokenizer):
    model = ScalarRewardModel.from_causal_lm(build_tiny_model("tiny-1m", tiny_tokenizer, seed=2))
    source = save_reward_model(tmp_path / "rm", model, tiny_tokenizer, mean=0.25, std=2.0)
    export_model(source, tmp_path / "half", dtype="bfloat16")
    assert (tmp_path / "half" / STATS_FILE).read_text() == (source / STATS_FILE).read_text()
    weights = load_file(str(tmp_path / "half" / "model.safetensors"))
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16} and "score.weight" in weights
    ids = [[3, 30, 31, 1, 40, 1]]
    full, half = load_reward_model(source).score_ids(ids)[0], load_reward_model(tmp_path / "half").score_ids(ids)[0]
    assert half == pytest.approx(full, abs=0.05)  # bf16 weights, same function


def test_bad_sources_are_clear_errors(tmp_path, tiny_tokenizer):
    with pytest.raises(ModelError, match="no such directory"):
        export_model(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="not a model directory"):
        export_model(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(ModelError, match="would replace what is exported"):
        export_model(tmp_path / "empty", tmp_path)
    with pytest.raises(ModelError, match="--dtype"):
        export_model(tmp_path / "empty", tmp_path / "out", dtype="int8")


def test_a_destination_holding_anything_but_a_model_is_never_replaced(tmp_path, tiny_tokenizer):
    """`posttrain export runs/sft ~/models` replaced the whole directory: every other model in it was deleted."""
    source = save_model_dir(tmp_path / "model", build_tiny_model("tiny-1m", tiny_tokenizer, seed=3), tiny_tokenizer)
    shelf = tmp_path / "models"
    (shelf / "other-model").mkdir(parents=True)
    (shelf / "other-model" / "weights.bin").write_bytes(b"precious")
    with pytest.raises(ModelError, match="not empty and holds no model"):
        export_model(source, shelf)
    assert (shelf / "other-model" / "weights.bin").read_bytes() == b"precious"
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ModelError, match="a file is there"):
        export_model(source, tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    # a new path, an empty directory and an earlier export are written
    (tmp_path / "empty").mkdir()
    for destination in (shelf / "exported", tmp_path / "empty", shelf / "exported"):
        assert (export_model(source, destination) / "config.json").is_file()
