"""Images in the main RL loop: the episode loop on image prompts (a prompt renderer built from the processor), the
RL update's micro-batch carrying the image tensors, and `posttrain rl` (`run_rl`) with a vision-language policy,
on the built-in tiny VLM (a real LLaVA model) and real Pillow-drawn image tasks."""

import json

import pytest
import torch

from posttrain.config import ConfigError, RLRecipe
from posttrain.envs import run_episodes
from posttrain.evaluate import image_sample
from posttrain.models import build_tiny_vlm, load_vision_model, vision_request
from posttrain.rl import ProcessorRenderer, image_engine, run_rl
from posttrain.rl.update import collate_trajectories
from posttrain.tasks import get_domain, sample_tasks
from posttrain.train import scored_token_stats
from posttrain.types import FailureClass, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def vlm(tiny_tokenizer):
    return build_tiny_vlm(tiny_tokenizer, seed=0)


def _tasks(count, name="largest_colour"):
    return sample_tasks(get_domain(name, canvas=32), count, level=[1], split="train", seed=3)


def _scored(model, trajectories, image_inputs=None):
    """The trainer's log-probs of every sampled token, as the RL update computes them (`collate_trajectories`,
    `scored_token_stats`), with the micro-batch's image tensors or `image_inputs` in their place."""
    micro = collate_trajectories(trajectories, [1.0] * len(trajectories), 0, torch.device("cpu"))
    images = micro.image_inputs if image_inputs is None else image_inputs(micro.image_inputs)
    with torch.no_grad():
        stats = scored_token_stats(model, micro.input_ids, micro.score_mask, micro.targets,
                                   attention_mask=micro.attention_mask, **images)
    return stats.logprobs, micro


def test_the_episode_loop_samples_image_prompts_and_the_update_scores_them_with_the_image(vlm):
    model, processor = vlm
    model.eval()
    engine = image_engine(model, processor)
    tasks = _tasks(2) + _tasks(1, "bar_value")  # prompts of different lengths in one micro-batch
    renderer = ProcessorRenderer(processor)
    trajectories = run_episodes(engine, tasks, processor.tokenizer, SamplingParams(max_new_tokens=5, seed=1), n=2,
                                renderer=renderer)
    assert all(not t.reward.is_infrastructure_failure for t in trajectories)
    for task, trajectory in zip([t for t in tasks for _ in range(2)], trajectories):
        sample = image_sample(task)
        request = vision_request(processor, sample.messages, sample.images)
        # the prompt is the processor's (image tokens expanded), and the trajectory carries its pixel tensors
        assert trajectory.token_ids[:trajectory.prompt_length] == request.prompt_token_ids
        assert torch.equal(trajectory.image_inputs["pixel_values"], request.image_inputs["pixel_values"])
        assert trajectory.policy_tokens > 0
    logprobs, micro = _scored(model, trajectories)
    assert micro.image_inputs["pixel_values"].shape[0] == len(trajectories)  # one image per row, in row order
    behaviour = micro.behaviour
    assert logprobs.shape == behaviour.shape
    assert float((logprobs - behaviour).abs().max()) < 1e-4  # exactly the sampled tokens, with the image
    black, _ = _scored(model, trajectories, lambda images: {k: torch.zeros_like(v) for k, v in images.items()})
    assert float((black - behaviour).abs().max()) > 1e-2  # the image is in the score: zeroing it changes it
    # rows in another order carry their own images along
    reordered, _ = _scored(model, trajectories[::-1])
    counts = [t.policy_tokens for t in trajectories]
    back = torch.cat(list(reversed(torch.split(reordered, counts[::-1]))))
    assert torch.allclose(back, logprobs, atol=1e-5)


def test_a_restored_trajectory_gets_its_image_tensors_rendered_again(vlm):
    model, processor = vlm
    renderer = ProcessorRenderer(processor)
    (trajectory,) = run_episodes(image_engine(model, processor), _tasks(1), processor.tokenizer,
                                 SamplingParams(max_new_tokens=3, seed=0), renderer=renderer)
    restored = type(trajectory).from_dict(json.loads(json.dumps(trajectory.to_dict())))
    assert restored.image_inputs is None  # a checkpointed batch keeps the image's reference (messages), no pixels
    with pytest.raises(ValueError, match="holds an image but it carries no image tensors"):
        collate_trajectories([restored], [1.0], 0, torch.device("cpu"))
    assert renderer.attach([restored]) == 1
    assert torch.equal(restored.image_inputs["pixel_values"], trajectory.image_inputs["pixel_values"])


def test_a_multi_turn_image_transcript_appends_observations_after_the_image_prompt(vlm):
    from posttrain.envs import EnvError, TranscriptTokens
    from posttrain.types import Completion

    _, processor = vlm
    tokenizer = processor.tokenizer
    (task,) = _tasks(1)
    tokens = TranscriptTokens(tokenizer, task.messages, renderer=ProcessorRenderer(processor))
    prompt = list(tokens.token_ids)
    reply = tokenizer.encode("red", add_special_tokens=False) + [tokenizer.eos_token_id]
    tokens.add_policy_turn(Completion(reply, "red", [-0.5] * len(reply), "stop", 3),
                           {"role": "assistant", "content": "red"})
    delta = tokens.add_observation([{"role": "user", "content": "Are you sure?"}])
    # the prompt's ids and tensors stay, the reply is the engine's ids, the delta is the template's new text only
    assert tokens.token_ids == prompt + reply + delta
    assert tokens.loss_mask == [0] * len(prompt) + [1] * len(reply) + [0] * len(delta)
    assert tokenizer.decode(delta).replace(" ", "").startswith("<|user|>Areyousure?")
    assert tokens.image_inputs["pixel_values"].shape[0] == 1
    with pytest.raises(EnvError, match="images are taken in the prompt only"):
        tokens.add_observation([{"role": "user", "content": task.messages[0]["content"]}])


def test_without_a_renderer_an_image_task_is_refused_never_run_without_its_image(vlm):
    model, processor = vlm
    (trajectory,) = run_episodes(image_engine(model, processor), _tasks(1), processor.tokenizer,
                                 SamplingParams(max_new_tokens=3))
    assert trajectory.reward.failure == FailureClass.INFRA
    assert "image part" in trajectory.reward.details["error"]


LOWERCASE = """def lowercase(completion, task):
    return 1.0 if completion[:1].islower() else 0.0
"""


def _recipe(tmp_path, **model):
    # A reward the untrained tiny VLM meets by chance (its answer starts with a lowercase letter), so groups carry
    # signal from the first step; the task's own verifier is logged beside it.
    (tmp_path / "rewards.py").write_text(LOWERCASE)
    return RLRecipe.model_validate({
        "output_dir": str(tmp_path / "run"),
        "rewards": [{"function": f"{tmp_path / 'rewards.py'}:lowercase"}, {"verifier": "task", "weight": 0.0}],
        "model": {"vision": True, "preset": "tiny-1m", **model},
        "domains": [{"name": "largest_colour", "args": {"canvas": 32}, "levels": [1], "heldout": 4},
                    {"name": "bar_value", "args": {"canvas": 32}, "levels": [1], "heldout": 0}],
        "rollout": {"prompts_per_step": 2, "sampling": {"group_size": 4, "max_new_tokens": 4, "temperature": 1.0},
                    "infra_retries": 0},
        "optim": {"lr": 1e-3, "schedule": "constant"},
        "train": {"max_steps": 2, "micro_batch_size": 8, "save_every": 1},
        "pipeline": {"max_staleness": 0},
        "schedule": {"guard": {"enabled": False}},
        "runtime": {"precision": "fp32", "seed": 0},
        "tracking": {"tensorboard": False, "progress": False},
    })


@pytest.mark.slow
def test_run_rl_trains_a_vision_language_policy_on_image_tasks(tmp_path, monkeypatch):
    import posttrain.rl.update as update

    scored = update.scored_token_stats
    calls = []

    def watched(model, input_ids, select, targets, **kwargs):
        """The update's own scoring, watched: each micro-batch's image tensors, and how far the scores move when
        its images are zeroed (the same tokens scored without what the images show)."""
        stats = scored(model, input_ids, select, targets, **kwargs)
        pixels = kwargs.get("pixel_values")
        if pixels is not None:
            with torch.no_grad():
                zeroed = {**kwargs, "pixel_values": torch.zeros_like(pixels)}
                blank = scored(model, input_ids, select, targets, **zeroed)
            moved = float((blank.logprobs - stats.logprobs.detach()).abs().max())
        calls.append((input_ids.shape[0], None if pixels is None else pixels.shape[0],
                      moved if pixels is not None else 0.0))
        return stats

    monkeypatch.setattr(update, "scored_token_stats", watched)
    result = run_rl(_recipe(tmp_path))
    assert calls and all(rows == images for rows, images, _ in calls)  # every row's image, in every micro-batch
    assert min(moved for _, _, moved in calls) > 1e-2  # the scores depend on the pixels
    assert result.steps == 2
    assert any(m["train/grad_norm"] > 0 for m in result.history)  # mixed groups: the policy moved
    for metrics in result.history:
        assert metrics["rollout/infra_masked"] == 0
        assert metrics["train/tokens"] > 0  # sampled tokens reached the update
        # the trainer scored the tokens the engine sampled, from the weights it had just pushed, with the image
        # (without it the tiny VLM's log-probs move by ~0.6 nats: docs/multimodal.md)
        assert metrics["train/gap_abs_max"] < 1e-4
    assert "heldout/largest_colour" in result.history[-1] or result.heldout  # image suites evaluated
    assert set(result.heldout) >= {"largest_colour"}
    episodes = [json.loads(line) for line in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 2 * 2 * 4
    first = episodes[0]["messages"][0]["content"]
    assert any(part.get("type") == "image_url" for part in first)  # the task's image, by its own data: URL
    model, processor = load_vision_model(str(result.final_dir))  # the final directory holds the processor
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == model.config.image_token_id


def test_what_the_image_path_does_not_take_is_refused_before_anything_loads(tmp_path):
    recipe = _recipe(tmp_path).model_copy(update={"algorithm": RLRecipe().algorithm.model_copy(
        update={"advantage": "gae"})})
    with pytest.raises(ConfigError, match="gae"):
        run_rl(recipe)


def test_a_checkpoint_of_a_vision_language_policy_loads_back_in_place(vlm, tmp_path):
    """RL's resume copies a checkpoint into the live model (the optimizer keeps its references): LLaVA writes its
    weights under other names than its modules', so the copy goes through transformers' own reading."""
    from posttrain.models import load_weights_from_checkpoint, save_model_dir

    model, processor = vlm
    save_model_dir(tmp_path / "ckpt", model, processor)
    live = build_tiny_vlm(processor.tokenizer, seed=1)[0]
    parameter = next(live.parameters())
    load_weights_from_checkpoint(live, tmp_path / "ckpt")
    assert next(live.parameters()) is parameter  # in place
    for (name, value), (_, expected) in zip(live.state_dict().items(), model.state_dict().items()):
        assert torch.equal(value, expected), name


def test_validate_shows_the_image_prompt_as_the_processor_renders_it(capsys):
    from posttrain.cli import main

    assert main(["validate", "grpo-vlm"]) == 0
    out = capsys.readouterr().out
    assert "prompts rendered by its processor (LlavaProcessor)" in out
    assert "<|user|><image>What colour is the largest shape" in out  # the image's place, never its data: URL
    assert "data:image" not in out and "nothing was trained" in out


@pytest.mark.slow
def test_posttrain_rl_runs_the_packaged_image_recipe_and_resumes(tmp_path):
    from posttrain.cli import main

    run = tmp_path / "run"
    shrink = [f"output_dir={run}", "train.save_every=1", "rollout.prompts_per_step=2", "rollout.sampling.group_size=4",
              "runtime.num_threads=1", "domains.0.heldout=2", "domains.1.heldout=2",
              "runtime.precision=fp32"]  # the gap bound below is fp32's (bf16, where `auto` picks it: ~1e-3)
    assert main(["rl", "grpo-vlm", "train.max_steps=1", *shrink]) == 0
    assert main(["rl", "grpo-vlm", "train.max_steps=2", *shrink, "--resume"]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2]
    assert all(m["train/gap_abs_max"] < 1e-4 for m in metrics if "train/gap_abs_max" in m)
