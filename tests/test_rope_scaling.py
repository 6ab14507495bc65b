"""`model.rope_scaling`: every kind builds the model transformers would build, survives a save/load, extends the
engine's context, and the engine's log-probs past the original length agree with transformers' teacher-forced
forward (the fast decoder for the length-independent kinds, the generic runner for dynamic NTK)."""

from __future__ import annotations

import logging

import pytest
import torch

from posttrain.config import ModelConfig, RopeScalingConfig
from posttrain.models import (
    RopeScalingError,
    build_tiny_model,
    context_length,
    load_model,
    save_model_dir,
)
from posttrain.rollout import HFEngine
from posttrain.train.forward import target_logprobs
from posttrain.types import GenerationRequest, SamplingParams

ORIGINAL = 32  # short, so a 60-token sequence is well past the trained length
KINDS = ["linear", "dynamic", "yarn", "llama3"]


pytestmark = pytest.mark.usefixtures("one_thread")


def scaled(kind: str, tokenizer, factor: float = 4.0):
    scaling = RopeScalingConfig(type=kind, factor=factor, original_max_position_embeddings=ORIGINAL)
    model = build_tiny_model("tiny-1m", tokenizer, seed=0, rope_scaling=scaling).eval()
    with torch.no_grad():  # random init gives flat logits; sharpen them so position errors show in log-probs
        model.lm_head.weight.mul_(8.0)
    model.set_attn_implementation("eager")
    return model, scaling


def teacher_forced(model, sequence: list[int], start: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([sequence]), use_cache=False).logits[0, :-1].float()
    return target_logprobs(logits, torch.tensor(sequence[1:]))[start:]


@pytest.mark.parametrize("kind", KINDS)
def test_the_scaling_is_in_the_config_and_extends_the_context(kind, tiny_tokenizer):
    model, _ = scaled(kind, tiny_tokenizer)
    assert model.config.rope_parameters["rope_type"] == kind
    assert model.model.rotary_emb.rope_type == kind
    assert context_length(model.config) == 4 * ORIGINAL
    engine = HFEngine(model, tiny_tokenizer)
    assert engine.max_length == 4 * ORIGINAL


@pytest.mark.parametrize("kind", ["linear", "yarn", "llama3"])
def test_length_independent_kinds_take_the_fast_decoder_and_agree_with_transformers(kind, tiny_tokenizer):
    model, _ = scaled(kind, tiny_tokenizer)
    engine = HFEngine(model, tiny_tokenizer)
    assert engine.runner == "fast"
    _assert_engine_matches_forward(engine, model)


def test_dynamic_ntk_falls_back_with_a_logged_reason(tiny_tokenizer, caplog):
    model, _ = scaled("dynamic", tiny_tokenizer)
    with caplog.at_level(logging.WARNING, logger="posttrain.rollout.engine"):
        engine = HFEngine(model, tiny_tokenizer)
    assert engine.runner == "generic"
    assert "rope type 'dynamic'" in caplog.text
    # Within the original length dynamic NTK is the plain rotary embedding, and the generic runner agrees.
    _assert_engine_matches_forward(engine, model, prompt_length=12, new_tokens=12)


def test_dynamic_ntk_past_the_original_length_differs_from_a_forward_by_construction(tiny_tokenizer):
    """Dynamic NTK's frequencies depend on the longest position seen: cached keys were rotated at an
    earlier length. This pins that property (it is why the fast decoder refuses the kind). Two fresh
    models: transformers' dynamic module keeps the longest length it has seen (its state is part of it)."""
    sequence = [(7 * i) % 300 + 3 for i in range(3 * ORIGINAL)]
    whole = teacher_forced(scaled("dynamic", tiny_tokenizer)[0], sequence, 0)
    # within the original length: the plain rotary embedding
    short = teacher_forced(scaled("dynamic", tiny_tokenizer)[0], sequence[:ORIGINAL], 0)
    assert torch.allclose(whole[: ORIGINAL - 1], short, atol=1e-5) is False


def _assert_engine_matches_forward(engine, model, prompt_length: int = 40, new_tokens: int = 24) -> None:
    prompts = [[(5 * i) % 300 + 3 for i in range(prompt_length)],
               [(11 * i) % 290 + 5 for i in range(prompt_length - 9)]]
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, n=2, seed=0)
    groups = engine.generate([GenerationRequest(p) for p in prompts], sampling)
    longest = 0
    for prompt, group in zip(prompts, groups):
        for completion in group:
            sequence = prompt + completion.token_ids
            longest = max(longest, len(sequence))
            expected = teacher_forced(model, sequence, len(prompt) - 1)
            gap = (torch.tensor(completion.logprobs) - expected).abs().max().item()
            assert gap < 1e-4, f"{engine.runner} runner: log-prob gap {gap:.3g}"
    if prompt_length > ORIGINAL:
        assert longest > ORIGINAL  # the comparison covered positions past the trained length


@pytest.mark.parametrize("kind", ["yarn", "dynamic"])
def test_a_saved_extended_model_reloads_with_the_same_function(kind, tiny_tokenizer, tmp_path):
    model, scaling = scaled(kind, tiny_tokenizer)
    save_model_dir(tmp_path / "m", model, tiny_tokenizer)
    plain = load_model(ModelConfig(path=str(tmp_path / "m"), attn_implementation="eager"), tiny_tokenizer)
    again = load_model(ModelConfig(path=str(tmp_path / "m"), attn_implementation="eager", rope_scaling=scaling),
                       tiny_tokenizer)
    sequence = [(3 * i) % 300 + 4 for i in range(3 * ORIGINAL)]
    expected = teacher_forced(model, sequence, 0)
    for reloaded in (plain, again):
        assert context_length(reloaded.config) == 4 * ORIGINAL
        assert torch.allclose(teacher_forced(reloaded.eval(), sequence, 0), expected, atol=1e-5)


def test_a_second_different_scaling_is_refused(tiny_tokenizer, tmp_path):
    model, _ = scaled("linear", tiny_tokenizer)
    save_model_dir(tmp_path / "m", model, tiny_tokenizer)
    other = RopeScalingConfig(type="yarn", factor=2.0)
    with pytest.raises(RopeScalingError, match="already uses rope type 'linear'"):
        load_model(ModelConfig(path=str(tmp_path / "m"), rope_scaling=other), tiny_tokenizer)


def test_the_recipe_section_is_strict():
    with pytest.raises(ValueError):
        ModelConfig(rope_scaling={"type": "linear", "factor": 0.5})
    with pytest.raises(ValueError):
        ModelConfig(rope_scaling={"type": "ntk", "factor": 2})
    assert ModelConfig(rope_scaling={"type": "llama3", "factor": 8}).rope_scaling.high_freq_factor == 4.0


def test_the_recipe_setting_extends_the_built_in_model(tiny_tokenizer):
    config = ModelConfig(preset="tiny-1m", rope_scaling={"type": "llama3", "factor": 8})
    model = load_model(config, tiny_tokenizer)
    assert model.config.max_position_embeddings == 8 * 1024
    assert model.config.rope_parameters["original_max_position_embeddings"] == 1024


def test_the_tokenizer_cap_follows_the_extended_context(tiny_tokenizer):
    """The built-in tokenizer caps contexts at 4,096 tokens (the episode loop and eval bound a context by it): an
    extended model raises the cap to its own length, and a model without scaling leaves it alone."""
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.model_max_length = 4096
    scaling = RopeScalingConfig(type="linear", factor=8.0, original_max_position_embeddings=1024)
    load_model(ModelConfig(preset="tiny-1m", rope_scaling=scaling), tokenizer)
    assert tokenizer.model_max_length == 8192
    load_model(ModelConfig(preset="tiny-1m"), tokenizer)
    assert tokenizer.model_max_length == 8192  # only ever raised
    short = copy.deepcopy(tiny_tokenizer)
    short.model_max_length = 4096
    load_model(ModelConfig(preset="tiny-1m"), short)
    assert short.model_max_length == 4096


def test_an_eval_policy_extends_the_model_as_the_training_run_does(tiny_tokenizer, tmp_path):
    """The demo's SFT validation engine follows a model trained from an unextended base: built from the base
    directory alone it would refuse every prompt past the base's 1,024 positions (as the first long-context run
    did, scoring its validation 0%); given the recipe's `rope_scaling` it holds what the trained model holds."""
    from posttrain.evaluate import load_policy

    save_model_dir(tmp_path / "base", build_tiny_model("tiny-1m", tiny_tokenizer, seed=0), tiny_tokenizer)
    assert load_policy(tmp_path / "base").engine.max_length == 1024
    scaling = RopeScalingConfig(type="linear", factor=8.0, original_max_position_embeddings=1024)
    policy = load_policy(tmp_path / "base", rope_scaling=scaling)
    assert policy.engine.max_length == 8192
    assert policy.engine.model.config.rope_parameters["rope_type"] == "linear"
