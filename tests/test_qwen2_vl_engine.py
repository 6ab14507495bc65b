"""Qwen2-VL through the built-in engine, `posttrain eval` and `posttrain rl`: a tiny Qwen2-VL built from its config
(`test_models_vision._qwen2_vl`) on real Pillow-drawn image tasks. Its text model places an image's tokens by 3-D
rotary positions (M-RoPE: time, row and column in the image's grid), so the engine's positions are not one per
token; the engine's tokens and log-probs must be transformers' own, and the trainer's the engine's."""

import copy
import dataclasses
import json

import pytest
import torch
from test_models_vision import _qwen2_vl
from test_rl_vision import _recipe

from posttrain.evaluate import image_sample
from posttrain.models import load_vision_model, save_model_dir, vision_request
from posttrain.rl import SelfTestError, engine_trainer_self_test, image_engine
from posttrain.rollout import HFEngine, RolloutError
from posttrain.tasks import get_domain, sample_tasks
from posttrain.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def _sharpened(model, std=0.3):
    """The text model's matrices drawn wider than the default 0.02: at 0.02 the 1-layer, 32-wide model barely
    attends by position, and 1-D positions in place of M-RoPE moved the log-probs by only 2e-5 (inside the
    self-test's 1e-3); at 0.3 they move them by ~5e-2 (seed 0)."""
    with torch.no_grad():
        for parameter in model.model.language_model.parameters():
            if parameter.ndim == 2:
                parameter.normal_(0.0, std)
    return model.eval()


@pytest.fixture(scope="module")
def qwen(tiny_tokenizer):
    torch.manual_seed(0)
    model, processor = _qwen2_vl(tiny_tokenizer)
    return _sharpened(model), processor


def _tasks():
    """Prompts of two lengths: a 64 px image (a 4x4 grid of patches, 2x2 tokens after merging) and a 32 px one
    (2x2 patches, one token)."""
    return (sample_tasks(get_domain("largest_colour", canvas=64), 2, level=[1], split="train", seed=3)
            + sample_tasks(get_domain("bar_value", canvas=32), 1, level=[1], split="train", seed=3))


def _requests(processor, tasks):
    return [vision_request(processor, image_sample(t).messages, image_sample(t).images) for t in tasks]


def _model_logprobs(model, request, tokens):
    """transformers' own forward on prompt + tokens with the image (it computes its M-RoPE positions itself)."""
    ids = torch.tensor([request.prompt_token_ids + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).long(),
                       **request.image_inputs).logits[0].float()
    start = len(request.prompt_token_ids)
    return torch.log_softmax(logits[start - 1 : -1], -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_the_engine_generates_from_qwen2_vl_image_prompts_as_transformers_does(qwen):
    model, processor = qwen
    engine = image_engine(model, processor)
    assert engine.runner == "generic"
    tasks = _tasks()
    requests = _requests(processor, tasks)
    grids = [r.image_inputs["image_grid_thw"].tolist() for r in requests]
    assert grids == [[[1, 4, 4]], [[1, 4, 4]], [[1, 2, 2]]]
    assert len({len(r.prompt_token_ids) for r in requests}) == 2  # one left-padded prefill for both lengths
    outputs = engine.generate(requests, SamplingParams(max_new_tokens=6, temperature=0.0))
    for request, (completion,) in zip(requests, outputs):
        ids = torch.tensor([request.prompt_token_ids])
        generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                   mm_token_type_ids=(ids == model.config.image_token_id).long(),
                                   **request.image_inputs, max_new_tokens=6, do_sample=False, eos_token_id=-1)
        assert completion.token_ids == generated[0, ids.shape[1]:].tolist()[: len(completion.token_ids)]
        expected = _model_logprobs(model, request, completion.token_ids)
        assert float((expected - torch.tensor(completion.logprobs)).abs().max()) < 1e-4
    # sampled groups (each prompt's rows share its prefill, rows are compacted as they stop) score the same way
    groups = engine.generate(requests, SamplingParams(n=3, max_new_tokens=5, temperature=1.0, seed=2))
    for request, group in zip(requests, groups):
        for completion in group:
            expected = _model_logprobs(model, request, completion.token_ids)
            assert float((expected - torch.tensor(completion.logprobs)).abs().max()) < 1e-4
    stats = engine_trainer_self_test(engine, model, processor.tokenizer, tasks, processor=processor,
                                     temperature=1.0, max_new_tokens=6)
    assert stats["gap_abs_max"] < 1e-4  # measured 5e-7


def test_positions_one_per_token_would_fail_the_image_self_test(qwen):
    """What the engine did before M-RoPE (each token at its index, the same on the three axes): the self-test
    catches it, so the positions are what makes the engine agree."""
    model, processor = qwen
    engine = image_engine(model, processor)
    engine._runner.rope_index = None
    with pytest.raises(SelfTestError, match="image self-test"):
        engine_trainer_self_test(engine, model, processor.tokenizer, _tasks(), processor=processor,
                                 temperature=1.0, max_new_tokens=6)


def test_the_fast_decoder_refuses_qwen2_vl(qwen):
    model, processor = qwen
    with pytest.raises(RolloutError, match="qwen2_vl"):
        HFEngine(copy.deepcopy(model), processor.tokenizer, runner="fast")


def test_a_sampled_image_placeholder_ends_the_reply_before_it(qwen):
    """The model may sample its own <|image_pad|> (this one did, in GRPO): the trainer's forward would take it for an
    image slot with no image and fail, so the engine ends the reply just before it."""
    from posttrain.train import ImageSequence, completion_logprobs

    model, processor = qwen
    engine = image_engine(model, processor)
    assert engine.placeholder_ids == {model.config.image_token_id, model.config.video_token_id}
    (request,) = _requests(processor, _tasks()[:1])
    with pytest.raises(ValueError, match="do not match"):
        completion_logprobs(model, [ImageSequence(request.prompt_token_ids, [model.config.image_token_id],
                                                  request.image_inputs)])
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    (full,), = engine.generate([request], greedy)
    assert full.finish_reason == "length" and len(full.token_ids) == 6
    cut_at = full.token_ids.index(full.token_ids[2])
    engine.placeholder_ids = frozenset({full.token_ids[2]})  # as if the third greedy token were the image token
    (cut,), = engine.generate([request], greedy)
    assert cut.token_ids == full.token_ids[:cut_at] and cut.logprobs == full.logprobs[:cut_at]
    assert cut.finish_reason == "stop"


def test_run_vision_grpo_on_qwen2_vl_keeps_the_engine_on_the_trainers_weights(qwen):
    """`rl.run_vision_grpo` (the image GRPO loop of its own): step 1 samples from the weights step 0 wrote, so the
    trainer's log-probs of those tokens (`completion_logprobs`, M-RoPE from the ids) are the engine's: ratio 1."""
    from posttrain.rl import run_vision_grpo

    model, processor = copy.deepcopy(qwen[0]), qwen[1]
    before = [p.detach().clone() for p in model.parameters()]
    # a format rule the untrained model meets by chance (an answer of odd length), so groups carry signal
    pool = [dataclasses.replace(t, verifier="format", verifier_args={"pattern": ODD_PATTERN, "full_match": False})
            for t in _tasks() * 4]
    result = run_vision_grpo(model, processor, lambda step, count: [pool[(step * count + i) % len(pool)]
                                                                    for i in range(count)],
                             steps=2, tasks_per_step=3, group_size=4, max_new_tokens=4, lr=1e-3, seed=0)
    assert result.self_test["gap_abs_max"] < 1e-4
    assert result.steps[0]["trained_sequences"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert result.steps[1]["trained_sequences"] > 0
    assert result.steps[1]["ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert result.steps[1]["ratio_max"] == pytest.approx(1.0, abs=1e-5)


ODD_PATTERN = r"^(?s:.)(?s:..)*$"


@pytest.fixture(scope="module")
def qwen_dir(qwen, tmp_path_factory):
    model, processor = qwen
    path = tmp_path_factory.mktemp("qwen2-vl")
    save_model_dir(path, model, processor)
    return path


def test_a_saved_qwen2_vl_loads_back_with_its_processor_without_torchvision(qwen, qwen_dir):
    model, processor = qwen
    loaded, loaded_processor = load_vision_model(str(qwen_dir))
    assert loaded_processor.video_processor is None  # built from its parts: images and text only
    (task,) = _tasks()[:1]
    request, again = _requests(processor, [task])[0], _requests(loaded_processor, [task])[0]
    assert again.prompt_token_ids == request.prompt_token_ids
    assert torch.equal(again.image_inputs["pixel_values"], request.image_inputs["pixel_values"])
    assert torch.equal(loaded.state_dict()["lm_head.weight"], model.state_dict()["lm_head.weight"])


def test_posttrain_eval_scores_image_suites_on_a_qwen2_vl_checkpoint(qwen_dir, tmp_path):
    from posttrain.config import EvalRecipe
    from posttrain.evaluate import evaluate

    recipe = EvalRecipe.model_validate({
        "output_dir": str(tmp_path / "eval"),
        "checkpoints": [{"path": str(qwen_dir), "label": "qwen"}],
        "suites": {"generated": [{"domain": "largest_colour", "args": {"canvas": 64}, "n": 3},
                                 {"domain": "bar_value", "args": {"canvas": 32}, "n": 3}]},
        "sampling": {"max_new_tokens": 4}, "fresh_draw": {"enabled": False},
        "runtime": {"device": "cpu", "precision": "fp32", "num_threads": 1, "batch_size": 8},
    })
    result = evaluate(recipe)
    images = result.results["images"]["qwen"]
    assert set(images) == {"largest_colour", "bar_value"}
    for suite in images.values():
        assert 0.0 <= suite["pass@1"] <= 1.0 and suite["samples"]
        assert all(s["thumbnail"].startswith("data:image/png;base64,") for s in suite["samples"])
    assert 'id="images"' in result.report_path.read_text()


# A reward the untrained model meets by chance (an answer of odd length), so groups carry signal from step 1; the
# task's own verifier is logged beside it at weight 0.
ODD_LENGTH = """def odd_length(completion, task):
    return float(len(completion) % 2)
"""


@pytest.mark.slow
def test_posttrain_rl_trains_a_qwen2_vl_policy_with_the_engines_logprobs(qwen_dir, tmp_path):
    """Two GRPO steps of `run_rl` from the saved Qwen2-VL: the start-up self-test on image prompts passes, the
    trainer scores exactly the engine's sampled tokens after each weight push, and `final/` loads back. 15 s on
    the shared 2-core machine at load ~4 (8 s of CPU)."""
    from posttrain.config import RLRecipe
    from posttrain.rl import run_rl

    # the LLaVA run's recipe (test_rl_vision), from this directory
    base = _recipe(tmp_path, path=str(qwen_dir)).model_dump(exclude_unset=True)
    (tmp_path / "odd.py").write_text(ODD_LENGTH)
    base["rewards"][0]["function"] = f"{tmp_path / 'odd.py'}:odd_length"
    base["domains"][0]["args"]["canvas"] = 64  # 2x2 merged image tokens, beside bar_value's one
    base["train"]["save_every"] = 2
    recipe = RLRecipe.model_validate(base)
    result = run_rl(recipe)
    assert result.steps == 2
    for metrics in result.history:
        assert metrics["rollout/infra_masked"] == 0 and metrics["train/tokens"] > 0
        assert metrics["train/gap_abs_max"] < 1e-4  # the trainer's log-probs are the engine's, with M-RoPE
    assert any(m["train/grad_norm"] > 0 for m in result.history)
    episodes = [json.loads(line) for line in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 2 * 2 * 4
    model, processor = load_vision_model(str(result.final_dir))
    assert model.config.model_type == "qwen2_vl" and processor.video_processor is None
