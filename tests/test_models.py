"""The built-in tiny model and tokenizer, local loading, LoRA, and atomic checkpoints."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.config import LoraConfig, ModelConfig
from posttrain.models import (
    ModelError,
    PRESETS,
    apply_lora,
    build_tiny_model,
    count_parameters,
    latest_checkpoint,
    load_model,
    load_tokenizer,
    load_training_state,
    load_weights_from_checkpoint,
    merged_copy,
    reference_mode,
    save_checkpoint,
    save_model_dir,
)

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "12+34"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12+34"}}}]},
    {"role": "tool", "name": "calculator", "content": "46"},
    {"role": "assistant", "content": "46"},
]


def test_tokenizer_splits_digits_and_round_trips(tiny_tokenizer):
    ids = tiny_tokenizer("12345 + héllo ☃", add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids) == "12345 + héllo ☃"  # byte-level: nothing is unknown
    digits = tiny_tokenizer("9081726354", add_special_tokens=False)["input_ids"]
    assert len(digits) == 10


def test_chat_template_renders_roles_and_tool_calls(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|system|>Be brief.<|end|><|user|>12+34<|end|>"
        '<|assistant|><tool_call>{"name": "calculator", "arguments": {"expression": "12+34"}}</tool_call><|end|>'
        "<|tool|>46<|end|><|assistant|>46<|end|><|assistant|>"
    )
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    for token in ("<|system|>", "<|end|>", "<tool_call>", "</tool_call>", "<|tool|>"):
        assert tiny_tokenizer.convert_tokens_to_ids(token) in ids
    assert tiny_tokenizer.eos_token == "<|end|>"


def test_presets_span_one_to_thirty_million(tiny_tokenizer):
    counts = {name: count_parameters(build_tiny_model(name, tiny_tokenizer)) for name in PRESETS}
    assert 0.7e6 < counts["tiny-1m"] < 1.5e6
    assert 20e6 < counts["tiny-30m"] < 35e6
    assert sorted(counts.values()) == list(counts.values())


def test_saved_model_loads_and_generates_with_plain_transformers(tmp_path, tiny_model, tiny_tokenizer):
    save_model_dir(tmp_path / "model", tiny_model, tiny_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    inputs = tokenizer.apply_chat_template(CHAT[:2], add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    with torch.no_grad():
        a = tiny_model(inputs["input_ids"]).logits
        b = model(inputs["input_ids"]).logits
    torch.testing.assert_close(a, b)


def test_loading_errors_are_clear(tmp_path, tiny_tokenizer):
    with pytest.raises(ModelError, match="is not a local directory"):
        load_tokenizer(ModelConfig(path=str(tmp_path / "missing")))
    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    (tmp_path / "tok" / "chat_template.jinja").unlink()
    with pytest.raises(ModelError, match="has no chat template; set model.chat_template"):
        load_tokenizer(ModelConfig(path=str(tmp_path / "tok")))
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tokenizer = load_tokenizer(ModelConfig(path=str(tmp_path / "tok"), chat_template=str(template)))
    assert tokenizer.apply_chat_template(CHAT[:2], tokenize=False) == "Be brief.12+34"
    with pytest.raises(ModelError, match="not a Hugging Face model directory"):
        load_model(ModelConfig(path=str(tmp_path / "tok")), tokenizer)


def test_lora_merge_equals_adapter_and_reference_is_base(tiny_model, tiny_tokenizer):
    ids = torch.tensor([[3, 20, 21, 22, 1]])
    with torch.no_grad():
        base_logits = tiny_model(ids).logits.clone()
    model = apply_lora(tiny_model, LoraConfig(enabled=True, r=4))
    assert count_parameters(model, trainable_only=True) < count_parameters(model) / 5
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)  # adapters start at zero; make them matter
        adapted = model(ids).logits
        with reference_mode(model):
            reference = model(ids).logits
        merged = merged_copy(model)(ids).logits
    torch.testing.assert_close(reference, base_logits)
    assert (adapted - base_logits).abs().max() > 1e-3
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-4)


def test_lora_with_no_matching_modules_is_an_error(tiny_model):
    with pytest.raises(ModelError, match=r"none of .* \(its linear layers: .*'q_proj'"):
        apply_lora(tiny_model, LoraConfig(enabled=True, target_modules=["c_attn"]))


def test_checkpoint_is_atomic_and_pruned(tmp_path, tiny_model, tiny_tokenizer):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, tiny_model, tiny_tokenizer, {"cursor": {"step": step}}, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert names == ["step-000002", "step-000003"]
    # A crash mid-write leaves a temporary directory behind; the latest complete checkpoint still wins.
    crashed = tmp_path / "checkpoints" / f".tmp-step-000004-{os.getpid()}"
    crashed.mkdir()
    (crashed / "config.json").write_text("{")
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step-000003"
    assert load_training_state(latest)["cursor"] == {"step": 3}
    assert AutoModelForCausalLM.from_pretrained(latest) is not None


def test_weights_round_trip_exactly(tmp_path, tiny_model, tiny_tokenizer):
    path = save_checkpoint(tmp_path, 1, tiny_model, tiny_tokenizer, {})
    other = build_tiny_model("tiny-1m", tiny_tokenizer, seed=1)
    load_weights_from_checkpoint(other, path)
    for (name, a), (_, b) in zip(tiny_model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name


def test_lora_checkpoint_resumes_adapter(tmp_path, tiny_tokenizer):
    model = apply_lora(build_tiny_model("tiny-1m", tiny_tokenizer), LoraConfig(enabled=True, r=2))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()
    path = save_checkpoint(tmp_path, 5, model, tiny_tokenizer, {})
    assert (path / "adapter" / "adapter_config.json").is_file()
    fresh = apply_lora(build_tiny_model("tiny-1m", tiny_tokenizer), LoraConfig(enabled=True, r=2))
    load_weights_from_checkpoint(fresh, path)
    ids = torch.tensor([[3, 20, 21]])
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, model(ids).logits)
    # and the model directory itself is the merged model, loadable without peft
    plain = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-4)
