"""Images through the engine and the training stages, on the built-in tiny VLM (a real LLaVA model) and real
Pillow-drawn image tasks: the engine samples from image prompts with exact tokens and log-probs (the self-test on
image prompts), SFT trains on the assistant tokens of image chats, DPO on image pairs, GRPO on the shapes tasks."""

import copy
import dataclasses

import pytest
import torch
from PIL import Image

from posttrain.data import validate_vision_record
from posttrain.evaluate import image_sample, sample_image_tasks, score_image_suite
from posttrain.models import build_tiny_vlm, vision_inputs, vision_request
from posttrain.rl import SelfTestError, engine_trainer_self_test, image_engine, run_vision_grpo, vision_grpo_update
from posttrain.rl.advantages import compute_advantages
from posttrain.rl.vision import _sequences
from posttrain.tasks import get_domain, sample_tasks
from posttrain.train import (
    VisionPair,
    completion_logprobs,
    run_vision_dpo,
    run_vision_sft,
    selected_logits,
    vision_sft_loss,
)
from posttrain.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def vlm(tiny_tokenizer):
    return build_tiny_vlm(tiny_tokenizer, seed=0)


def _tasks(count, name="largest_colour", level=1, split="train"):
    return sample_tasks(get_domain(name, canvas=32), count, level=[level], split=split)


def _self_test(engine, model, processor, tasks, temperature=1.0, max_new_tokens=8):
    """The RL self-test on image prompts: the processor renders each task's prompt with its image."""
    return engine_trainer_self_test(engine, model, processor.tokenizer, tasks, temperature=temperature,
                                    max_new_tokens=max_new_tokens, processor=processor)


def test_the_engine_samples_from_image_prompts_with_the_trainers_logprobs(vlm):
    model, processor = vlm
    engine = image_engine(model, processor)
    tasks = _tasks(3) + _tasks(1, "read_digits")  # prompts of different lengths share a left-padded prefill
    stats = _self_test(engine, model, processor, tasks, temperature=1.0, max_new_tokens=6)
    assert stats["gap_abs_max"] < 1e-4
    sampling = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=5)
    first = sample_image_tasks(engine, processor, tasks, sampling)
    again = sample_image_tasks(engine, processor, tasks, sampling)
    assert [[a.completion.token_ids for a in g] for g in first] == [[a.completion.token_ids for a in g] for g in again]


def test_greedy_engine_tokens_equal_transformers_generate_with_the_image(vlm):
    model, processor = vlm
    engine = image_engine(model, processor)
    (task,) = _tasks(1)
    sample = image_sample(task)
    request = vision_request(processor, sample.messages, sample.images)
    (completion,), = engine.generate([request], SamplingParams(max_new_tokens=5, temperature=0.0))
    ids = torch.tensor([request.prompt_token_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **request.image_inputs,
                         max_new_tokens=5, do_sample=False, eos_token_id=-1)
    assert completion.token_ids == out[0, ids.shape[1]:].tolist()[: len(completion.token_ids)]


def test_the_image_reaches_the_engine_and_stale_weights_fail_the_self_test(vlm):
    model, processor = vlm
    engine = image_engine(model, processor)
    (task,) = _tasks(1)
    sample = image_sample(task)
    black = validate_vision_record({"messages": [{"role": "user", "content": [
        {"type": "image", "image": Image.new("RGB", (32, 32), "black")}, *sample.messages[0]["content"][1:]]}]},
        require_assistant=False)
    greedy = SamplingParams(max_new_tokens=3, temperature=0.0)
    scored = [engine.generate([vision_request(processor, s.messages, s.images)], greedy)[0][0].logprobs
              for s in (sample, black)]
    assert scored[0] != scored[1]
    with torch.no_grad():  # the engine keeps the old weights while the trainer's move: the self-test says so
        changed = copy.deepcopy(model)
        for parameter in changed.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    with pytest.raises(SelfTestError, match="image self-test"):
        _self_test(engine, changed, processor, _tasks(2))


def _demonstrations(tasks):
    return [validate_vision_record({"messages": task.messages + [
        {"role": "assistant", "content": task.metadata["answer"]}]}) for task in tasks]


def test_sft_on_image_chats_learns_the_answers(tiny_tokenizer):
    model, processor = build_tiny_vlm(tiny_tokenizer, seed=1)
    samples = _demonstrations(_tasks(16))
    with torch.no_grad():
        before = float(vision_sft_loss(model, processor, samples[:4]))
    result = run_vision_sft(model, processor, samples, steps=12, lr=3e-3, batch_size=4, seed=0)
    assert result.losses[-1] < 0.5 * before


def test_the_sft_loss_is_the_token_mean_over_the_assistant_reply_alone(vlm):
    """The labels are exactly the reply's tokens and its end-of-turn (everything after the prompt the engine would
    be given), and the loss is the cross-entropy there, averaged over the batch's reply tokens."""
    model, processor = vlm
    tasks = _tasks(1) + _tasks(1, "read_digits", level=3)  # replies of different lengths: a token mean, not a row mean
    samples = _demonstrations(tasks)
    losses, counts = [], []
    with torch.no_grad():
        for task, sample in zip(tasks, samples):
            row = vision_inputs(processor, sample.messages, sample.images)
            ids, labels = row["input_ids"][0], row["labels"][0]
            prompt = vision_request(processor, sample.prompt_messages, sample.images).prompt_token_ids
            assert ids[: len(prompt)].tolist() == prompt
            assert (labels != -100).tolist() == [False] * len(prompt) + [True] * (len(ids) - len(prompt))
            reply = processor.tokenizer.decode(ids[len(prompt):])
            assert reply == task.metadata["answer"] + processor.tokenizer.eos_token
            logits = model(input_ids=ids[None], pixel_values=row["pixel_values"]).logits[0]
            losses.append(torch.nn.functional.cross_entropy(logits[len(prompt) - 1 : -1], ids[len(prompt):],
                                                            reduction="sum"))
            counts.append(len(ids) - len(prompt))
        expected = sum(losses) / sum(counts)
        assert counts[0] != counts[1]
        assert float(vision_sft_loss(model, processor, samples)) == pytest.approx(float(expected), rel=1e-5)


def test_dpo_on_image_pairs_prefers_the_chosen_answer(tiny_tokenizer):
    model, processor = build_tiny_vlm(tiny_tokenizer, seed=2)
    reference = copy.deepcopy(model)
    pairs = []
    for task in _tasks(8):
        sample = image_sample(task)
        wrong = next(c for c in ("red", "green", "blue", "yellow") if c != task.metadata["answer"])
        pairs.append(VisionPair(sample.messages, sample.images, task.metadata["answer"], wrong))
    result = run_vision_dpo(model, reference, processor, pairs, steps=8, lr=3e-3, beta=0.5, batch_size=4)
    assert result.losses[-1] < result.losses[0]
    assert result.metrics[-1]["reward_accuracy"] >= 0.75


def _lowercase_start_tasks(count):
    """Image tasks judged by a format rule the untrained policy meets by chance (its answer starts with a lowercase
    letter: 1 in 8 here), so groups carry signal from the first step without any training first."""
    return [dataclasses.replace(task, verifier="format", verifier_args={"pattern": "^[a-z]", "full_match": False})
            for task in _tasks(count)]


def test_a_grpo_update_raises_the_rewarded_answers_and_lowers_the_others(tiny_tokenizer):
    model, processor = build_tiny_vlm(tiny_tokenizer, seed=3)
    engine = image_engine(model, processor)
    sampling = SamplingParams(n=4, max_new_tokens=4, temperature=1.0, seed=0)
    answers = [a for group in sample_image_tasks(engine, processor, _lowercase_start_tasks(4), sampling)
               for a in group]
    advantages = compute_advantages([a.reward.score for a in answers], [a.task.id for a in answers])
    sequences = _sequences(answers)
    with torch.no_grad():
        before = [float(lp.sum()) for lp in completion_logprobs(model, sequences)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    figures = vision_grpo_update(model, optimizer, answers, pad_id=processor.tokenizer.pad_token_id)
    with torch.no_grad():
        after = [float(lp.sum()) for lp in completion_logprobs(model, sequences)]
    change = [b - a for a, b in zip(before, after)]
    rewarded = [c for c, adv in zip(change, advantages) if adv > 0]
    unrewarded = [c for c, adv in zip(change, advantages) if adv < 0]
    assert figures["trained_sequences"] == len(rewarded) + len(unrewarded) == 8  # two groups with mixed rewards
    assert figures["ratio_max"] == pytest.approx(1.0, abs=1e-5)  # on-policy: the engine sampled these weights
    assert min(rewarded) > 0.5 and max(unrewarded) < 0.0  # seed 0: every rewarded answer up, every other down


def test_grpo_trains_the_policy_and_keeps_the_engine_on_its_weights(tiny_tokenizer):
    model, processor = build_tiny_vlm(tiny_tokenizer, seed=3)
    before = [p.detach().clone() for p in model.parameters()]
    pool = _lowercase_start_tasks(24)
    result = run_vision_grpo(model, processor, lambda step, count: [pool[(step * count + i) % len(pool)]
                                                                    for i in range(count)],
                             steps=2, tasks_per_step=4, group_size=4, max_new_tokens=4, lr=1e-3, seed=0)
    assert result.self_test["gap_abs_max"] < 1e-4
    assert [s["trained_sequences"] for s in result.steps] == [8, 4]  # seed 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # step 1 sampled from the weights step 0 wrote: a stale engine would put the ratio far from 1 (the update moved
    # a sequence's log-prob by 0.2-2.2 nats, see the test above)
    assert result.steps[1]["ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert result.steps[1]["ratio_max"] == pytest.approx(1.0, abs=1e-5)


def test_the_trainer_forward_of_a_vlm_takes_the_image(vlm):
    """`selected_logits` runs a VLM whole: its decoder alone (the language model) would ignore `pixel_values`."""
    model, processor = vlm
    sample = image_sample(_tasks(1)[0])
    request = vision_request(processor, sample.messages, sample.images)
    ids = torch.tensor([request.prompt_token_ids])
    select = torch.ones(1, ids.shape[1] - 1, dtype=torch.bool)
    pixels = request.image_inputs["pixel_values"]
    with torch.no_grad():
        ours = selected_logits(model, ids, select, pixel_values=pixels)
        theirs = model(input_ids=ids, pixel_values=pixels).logits[0, :-1]
        black = selected_logits(model, ids, select, pixel_values=torch.zeros_like(pixels))
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert not torch.allclose(ours, black, atol=1e-3)


def test_an_image_suite_scores_per_domain_with_thumbnails(vlm):
    model, processor = vlm
    engine = image_engine(model, processor)
    tasks = _tasks(2) + _tasks(2, "shape_count")
    score = score_image_suite(engine, processor, tasks, name="held-out")
    assert set(score.per_domain) == {"largest_colour", "shape_count"}
    assert all(case.thumbnail.startswith("data:image/png;base64,") for case in score.cases)
    assert score.cases[0].question.startswith("What colour")
    assert score.pass_at_1 == pytest.approx(1 - len(score.failures) / len(score.cases))


def test_trainer_logprobs_do_not_depend_on_the_batch_padding(vlm):
    model, processor = vlm
    engine = image_engine(model, processor)
    answers = [g[0] for g in sample_image_tasks(engine, processor, _tasks(1) + _tasks(1, "read_digits", level=3),
                                                SamplingParams(max_new_tokens=4, temperature=1.0, seed=2))]
    with torch.no_grad():
        together = completion_logprobs(model, _sequences(answers))
        alone = [completion_logprobs(model, _sequences([a]))[0] for a in answers]
    for a, b in zip(together, alone):
        assert torch.allclose(a, b, atol=1e-5)


def test_the_report_shows_image_suites_and_thumbnails_of_bad_cases(vlm):
    from posttrain.evaluate import image_suite_json, render_report

    model, processor = vlm
    score = score_image_suite(image_engine(model, processor), processor, _tasks(2), name="held-out")
    page = render_report({"images": {"sft": {"held-out": image_suite_json(score)},
                                     "rl": {"held-out": {"pass@1": 1.0, "per_domain": {"largest_colour": 1.0},
                                                         "bad_cases": []}}}})
    assert '<section id="images">' in page and "largest_colour" in page
    assert "answered every image right" in page  # the last checkpoint's gallery
    page = render_report({"images": {"sft": {"held-out": image_suite_json(score)}}})
    # sample images with the answers (the first 8 cases, right or wrong), then the bad cases
    assert page.count('<img src="data:image/png;base64,') == len(score.cases[:8]) + len(score.failures)
    assert "Sample images with the answers of sft" in page
    hostile = image_suite_json(score)
    hostile["bad_cases"] = [{**hostile["bad_cases"][0], "thumbnail": "javascript:alert(1)", "answer": "<b>x"}]
    page = render_report({"images": {"x": {"s": hostile}}})
    assert "javascript:" not in page and "&lt;b&gt;x" in page


def test_lora_on_the_tiny_vlm_trains_adapters_and_the_engine_runs_the_merged_policy(tiny_tokenizer):
    from posttrain.config import LoraConfig
    from posttrain.models import apply_lora

    model, processor = build_tiny_vlm(tiny_tokenizer, seed=4)
    torch.manual_seed(0)  # the adapters' initialisation
    model = apply_lora(model, LoraConfig(r=4, alpha=8))
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    result = run_vision_sft(model, processor, _demonstrations(_tasks(8)), steps=6, lr=1e-2, batch_size=8)
    assert result.losses[-1] < result.losses[0]  # every step sees the same 8 chats
    assert all(torch.equal(p, frozen[name]) for name, p in model.named_parameters() if name in frozen)
    engine = image_engine(model, processor)  # the adapters merged into a plain copy
    assert _self_test(engine, model, processor, _tasks(2))["gap_abs_max"] < 1e-4


def test_the_vllm_engine_refuses_image_prompts_instead_of_dropping_the_image():
    from posttrain.rollout import RolloutError, VLLMEngine
    from posttrain.types import GenerationRequest

    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM here: the check runs before anything of vLLM's
    request = GenerationRequest([1, 2, 3], image_inputs={"pixel_values": torch.zeros(1, 3, 32, 32)})
    with pytest.raises(RolloutError, match="image prompts"):
        engine.generate([request], SamplingParams(max_new_tokens=2))
