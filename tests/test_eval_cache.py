"""The episode cache (`EvalRuntime.episode_cache`): an unchanged checkpoint's episodes on an unchanged item are
reused, and anything that changes an episode (the checkpoint's files, the sampling, the task) samples again;
infrastructure failures are never kept; a real checkpoint's second evaluation gives the same figures."""

from __future__ import annotations

import json

from test_envs_scripted import ScriptedEngine

from posttrain.config import EvalRecipe, EvalRuntime, EvalSampling
from posttrain.evaluate import Policy, evaluate, run_items
from posttrain.evaluate.cache import EpisodeCache, checkpoint_key
from posttrain.tasks import get_domain, sample_tasks

SETTINGS = {"device": "cpu", "autocast": "None"}


def arithmetic_tasks(n: int, seed: int = 1, level: int = 2):
    return sample_tasks(get_domain("arithmetic"), n, level=[level], split="heldout", seed=seed)


def scripted_policy(checkpoint, tokenizer, tasks, **engine_options) -> Policy:
    """Right on even items, one off on odd ones."""
    domain = get_domain("arithmetic")
    answers = {}
    for index, task in enumerate(tasks):
        right = domain.demonstration(task).messages[-1]["content"]
        answers[task.id] = [right if index % 2 == 0 else str(int(right) + 1)]
    return Policy(ScriptedEngine(tokenizer, answers, **engine_options), tokenizer, str(checkpoint), settings=SETTINGS)


def fake_checkpoint(tmp_path, weights: bytes = b"w"):
    """A checkpoint directory for the cache's key (the scripted engine does not read it)."""
    checkpoint = tmp_path / "model"
    checkpoint.mkdir(exist_ok=True)
    (checkpoint / "weights.bin").write_bytes(weights)
    return checkpoint


def summary(items):
    return [(item.task.id, item.greedy.reward.passed, item.greedy.token_ids,
             [(s.reward.passed, s.token_ids) for s in item.samples]) for item in items]


def test_a_second_run_reuses_every_episode_and_a_change_samples_again(tmp_path, tiny_tokenizer):
    checkpoint = fake_checkpoint(tmp_path, b"one")
    tasks = arithmetic_tasks(6)
    runtime = EvalRuntime(episode_cache=str(tmp_path / "cache"), batch_size=4)
    sampling = EvalSampling(max_new_tokens=16, n=2, k=[2], seed=3)

    first, stats = run_items(scripted_policy(checkpoint, tiny_tokenizer, tasks), tasks, sampling, runtime)
    assert (stats.episodes, stats.cached_episodes, stats.items_run) == (18, 0, 6)
    assert [item.greedy.reward.passed for item in first] == [True, False] * 3

    again = scripted_policy(checkpoint, tiny_tokenizer, tasks)
    second, stats = run_items(again, tasks, sampling, runtime)
    assert (stats.episodes, stats.cached_episodes, stats.items_run) == (0, 18, 0)
    assert again.engine.calls == []  # nothing generated
    assert summary(second) == summary(first)

    # One new item: only it is sampled.
    more = tasks + arithmetic_tasks(1, seed=9, level=3)
    policy = scripted_policy(checkpoint, tiny_tokenizer, more)
    _, stats = run_items(policy, more, sampling, runtime)
    assert (stats.episodes, stats.cached_episodes, stats.items_run) == (3, 18, 1)

    # Another sampling seed: the sampled episodes again, the greedy ones from the cache.
    _, stats = run_items(scripted_policy(checkpoint, tiny_tokenizer, tasks), tasks,
                         sampling.model_copy(update={"seed": 4}), runtime)
    assert (stats.episodes, stats.cached_episodes) == (12, 6)

    # Another task timeout (the verifier's budget): everything again.
    _, stats = run_items(scripted_policy(checkpoint, tiny_tokenizer, tasks), tasks, sampling,
                         runtime.model_copy(update={"timeout_scale": 2.0}))
    assert (stats.episodes, stats.cached_episodes) == (18, 0)

    # The checkpoint's weights changed: everything again.
    (checkpoint / "weights.bin").write_bytes(b"two")
    _, stats = run_items(scripted_policy(checkpoint, tiny_tokenizer, tasks), tasks, sampling, runtime)
    assert (stats.episodes, stats.cached_episodes) == (18, 0)

    # Off without the runtime setting, or for a policy with no checkpoint directory (a model still training).
    _, stats = run_items(scripted_policy(checkpoint, tiny_tokenizer, tasks), tasks, sampling, EvalRuntime())
    assert stats.cached_episodes == 0
    training = scripted_policy(tmp_path / "no-such-dir", tiny_tokenizer, tasks)
    _, stats = run_items(training, tasks, sampling, runtime)
    _, stats = run_items(training, tasks, sampling, runtime)
    assert stats.cached_episodes == 0


def test_infrastructure_failures_are_not_kept(tmp_path, tiny_tokenizer):
    checkpoint = fake_checkpoint(tmp_path)
    tasks = arithmetic_tasks(3)
    runtime = EvalRuntime(episode_cache=str(tmp_path / "cache"), infra_retries=0)
    sampling = EvalSampling(max_new_tokens=16)
    broken = scripted_policy(checkpoint, tiny_tokenizer, tasks, fail_on_turn=0)  # the engine fails every call
    items, _ = run_items(broken, tasks, sampling, runtime)
    assert all(item.greedy.reward.is_infrastructure_failure for item in items)
    _, stats = run_items(scripted_policy(checkpoint, tiny_tokenizer, tasks), tasks, sampling, runtime)
    assert (stats.episodes, stats.cached_episodes) == (3, 0)


def test_a_line_cut_short_is_sampled_again(tmp_path, tiny_tokenizer):
    checkpoint = fake_checkpoint(tmp_path)
    tasks = arithmetic_tasks(2)
    runtime = EvalRuntime(episode_cache=str(tmp_path / "cache"))
    sampling = EvalSampling(max_new_tokens=16)
    run_items(scripted_policy(checkpoint, tiny_tokenizer, tasks), tasks, sampling, runtime)
    cache_file = EpisodeCache(tmp_path / "cache", checkpoint_key(checkpoint, SETTINGS)).path
    lines = cache_file.read_text().splitlines()
    assert len(lines) == 2
    cache_file.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # a crash mid-write
    _, stats = run_items(scripted_policy(checkpoint, tiny_tokenizer, tasks), tasks, sampling, runtime)
    assert (stats.episodes, stats.cached_episodes) == (1, 1)


def test_a_real_checkpoint_evaluated_twice_gives_the_same_figures(tmp_path, tiny_tokenizer, tiny_model):
    from posttrain.models import save_model_dir

    save_model_dir(tmp_path / "run" / "final", tiny_model, tiny_tokenizer)
    recipe = EvalRecipe.model_validate({
        "output_dir": str(tmp_path / "eval"), "checkpoints": [str(tmp_path / "run" / "final")],
        "suites": {"generated": [{"domain": "arithmetic", "levels": [2], "n": 5}]},
        "sampling": {"max_new_tokens": 6, "n": 2, "k": [2]}, "fresh_draw": {"seed": 3},
        "runtime": {"batch_size": 8, "precision": "fp32", "episode_cache": str(tmp_path / "cache")},
    })
    first = evaluate(recipe).results
    second = evaluate(recipe).results
    assert first["checkpoints"][0]["episodes"] == 30 and first["checkpoints"][0]["cached_episodes"] == 0
    assert second["checkpoints"][0]["episodes"] == 0 and second["checkpoints"][0]["cached_episodes"] == 30
    assert second["checkpoints"][0]["items_per_s"] is None
    assert json.dumps(second["metrics"], sort_keys=True) == json.dumps(first["metrics"], sort_keys=True)
    assert json.dumps(second["examples"], sort_keys=True) == json.dumps(first["examples"], sort_keys=True)
