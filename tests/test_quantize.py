"""`posttrain quantize`: a real tiny Llama quantized by torchao, saved, reloaded by plain transformers and by
posttrain's loaders, generating through the engine and the server; int8 logits close to fp32; clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.config import ModelConfig
from posttrain.models import (
    ModelError,
    build_tiny_model,
    load_model,
    load_tokenizer,
    quantization_of,
    quantize_checkpoint,
    save_model_dir,
)
from posttrain.rollout import HFEngine, RolloutError
from posttrain.types import GenerationRequest, SamplingParams

pytest.importorskip("torchao")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    path = tmp_path_factory.mktemp("float") / "model"
    save_model_dir(path, build_tiny_model("tiny-1m", tiny_tokenizer, seed=3), tiny_tokenizer)
    return path


@pytest.fixture(scope="module")
def int8_dir(float_dir) -> Path:
    return quantize_checkpoint(float_dir, float_dir.with_name("model-int8"), to="int8")


@pytest.fixture(scope="module")
def int4_dir(float_dir) -> Path:
    return quantize_checkpoint(float_dir, float_dir.with_name("model-int4"), to="int4", group_size=32)


def _logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.inference_mode():
        return AutoModelForCausalLM.from_pretrained(directory).eval()(ids).logits.float()


def _ids(tiny_tokenizer) -> torch.Tensor:
    return torch.tensor([tiny_tokenizer("What is 12 + 30? Answer: 42 and then 7 - 3 = 4")["input_ids"]])


def test_int8_checkpoint_is_smaller_records_itself_and_reloads_quantized(float_dir, int8_dir):
    from transformers import AutoModelForCausalLM

    config = json.loads((int8_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "torchao"
    assert quantization_of(int8_dir)["target"] == "int8" and quantization_of(float_dir) is None
    assert (int8_dir / "tokenizer.json").is_file()
    float_bytes = (float_dir / "model.safetensors").stat().st_size
    assert (int8_dir / "model.safetensors").stat().st_size < 0.6 * float_bytes  # linears: 4 bytes -> 1
    model = AutoModelForCausalLM.from_pretrained(int8_dir)  # plain transformers, torchao installed
    weight = model.model.layers[0].mlp.up_proj.weight
    assert type(weight.data if isinstance(weight, torch.nn.Parameter) else weight) is not torch.Tensor


def test_int8_logits_are_close_to_fp32_and_int4_is_coarser(tiny_tokenizer, float_dir, int8_dir, int4_dir):
    ids = _ids(tiny_tokenizer)
    reference, int8, int4 = _logits(float_dir, ids), _logits(int8_dir, ids), _logits(int4_dir, ids)
    int8_error, int4_error = (int8 - reference).abs().max().item(), (int4 - reference).abs().max().item()
    scale = reference.abs().max().item()
    assert 0 < int8_error < 0.02 * scale  # quantized (not a float copy), and close
    assert (int8.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    assert int4_error > int8_error  # 16 levels per group against 255 per row


def test_a_quantized_checkpoint_generates_through_load_model_and_the_engine(tiny_tokenizer, int8_dir):
    config = ModelConfig(path=str(int8_dir))
    tokenizer = load_tokenizer(config)
    engine = HFEngine(load_model(config, tokenizer), tokenizer)
    assert engine.runner == "generic"  # the fast decoder's fused copies would dequantize the weights
    prompt = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                                add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completion = engine.generate([GenerationRequest(ids)], SamplingParams(max_new_tokens=8, temperature=0))[0][0]
    assert 1 <= len(completion.token_ids) <= 8 and len(completion.logprobs) == len(completion.token_ids)
    with pytest.raises(RolloutError, match="quantized weights"):
        HFEngine(load_model(config, tokenizer), tokenizer, runner="fast")


def test_serve_and_eval_load_a_quantized_checkpoint(int8_dir):
    from posttrain.evaluate import load_policy
    from posttrain.serve import make_backend, start_server

    policy = load_policy(int8_dir)
    assert policy.engine.runner == "generic"
    import urllib.request

    backend = make_backend(int8_dir, precision="fp32", num_threads=1)
    with start_server(backend, "quantized") as handle:
        body = json.dumps({"model": "quantized", "prompt": "1 + 1 =", "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(handle.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            reply = json.loads(response.read())
    assert reply["choices"][0]["finish_reason"] in ("length", "stop") and reply["usage"]["completion_tokens"] >= 1


def test_cli_quantize_and_its_errors(tmp_path, float_dir, int8_dir, tiny_tokenizer, capsys):
    from posttrain.cli import main
    from transformers import LlamaConfig, LlamaForSequenceClassification

    assert main(["quantize", str(float_dir), "--to", "int8", "--out", str(tmp_path / "q")]) == 0
    assert quantization_of(tmp_path / "q")["target"] == "int8"
    assert main(["quantize", str(float_dir), "--to", "int3"]) == 2
    assert "--to: expected one of int8, int4, got 'int3'" in capsys.readouterr().err
    with pytest.raises(ModelError, match="already quantized"):
        quantize_checkpoint(int8_dir, tmp_path / "twice", to="int8")
    with pytest.raises(ModelError, match="--group-size 48: does not divide"):
        quantize_checkpoint(float_dir, tmp_path / "g", to="int4", group_size=48)
    with pytest.raises(ModelError, match="no such directory"):
        quantize_checkpoint(tmp_path / "missing", tmp_path / "m", to="int8")
    with pytest.raises(ModelError, match="would replace"):
        quantize_checkpoint(float_dir, float_dir, to="int8")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    with pytest.raises(ModelError, match="not empty and holds no model"):  # it was replaced whole
        quantize_checkpoint(float_dir, tmp_path / "mine", to="int8")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "kept"
    scorer = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=32,
                                                        intermediate_size=64, num_hidden_layers=1,
                                                        num_attention_heads=2, num_labels=1))
    scorer.save_pretrained(tmp_path / "rm")
    with pytest.raises(ModelError, match="quantize takes a causal LM"):
        quantize_checkpoint(tmp_path / "rm", tmp_path / "rm-q", to="int8")
    assert not (tmp_path / "twice").exists() and not (tmp_path / "g").exists()


def test_loading_a_quantized_checkpoint_without_torchao_names_the_fix(int8_dir, tiny_tokenizer, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    # A fake of one thing that cannot be arranged here: torchao absent from an environment that has it.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ModelError, match=r"torchao-quantized checkpoint.*pip install 'posttrain\[quantize\]'"):
        load_model(ModelConfig(path=str(int8_dir)), tiny_tokenizer)


def test_a_lora_adapter_is_merged_then_quantized(tmp_path, tiny_tokenizer, float_dir):
    from test_export import save_trained_adapter
    from transformers import AutoModelForCausalLM

    from posttrain.models import export_model, merged_copy

    base = AutoModelForCausalLM.from_pretrained(float_dir)
    model = save_trained_adapter(base, float_dir, tiny_tokenizer, tmp_path / "adapter")

    quantized = quantize_checkpoint(tmp_path / "adapter", tmp_path / "adapter-int8", to="int8")
    exported = export_model(tmp_path / "adapter", tmp_path / "merged")
    by_hand = quantize_checkpoint(exported, tmp_path / "merged-int8", to="int8")
    ids = _ids(tiny_tokenizer)
    with torch.inference_mode():
        merged, plain = merged_copy(model).eval()(ids).logits, base.eval()(ids).logits
    got = _logits(quantized, ids)
    assert (got - merged).abs().max() < (got - plain).abs().max()  # the adapter's change is in the weights
    torch.testing.assert_close(got, _logits(by_hand, ids), rtol=0, atol=0)  # = export, then quantize
    assert not any(p.name.startswith(".quantize-") for p in tmp_path.iterdir())  # the merge scratch is gone
