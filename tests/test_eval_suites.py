"""Eval suites and the contamination check: held-out hygiene, fresh draws, dataset and regression suites,
n-gram / exact-prompt overlap with SFT, preference and RL data, exclusion."""

from __future__ import annotations

import json

import pytest

from posttrain.config import EvalRecipe
from posttrain.evaluate import (
    EvalError,
    build_suites,
    check_contamination,
    exclude_contaminated,
    fresh_draw,
    generated_suite,
    hygiene,
    tasks_suite,
    training_samples,
)
from posttrain.tasks import get_domain, sample_tasks
from posttrain.types import Task

HYGIENE_DOMAINS = [("arithmetic", [2, 3]), ("extraction", [1, 2]), ("calculator", [1, 2]),
                   ("long_doc_qa", [1, 2]), ("safety", [1, 2, 3])]


def _recipe(tmp_path, **overrides) -> EvalRecipe:
    data = {"output_dir": str(tmp_path / "out"), "checkpoints": [str(tmp_path / "model")]}
    data.update(overrides)
    return EvalRecipe.model_validate(data)


@pytest.mark.parametrize("name,levels", HYGIENE_DOMAINS)
def test_heldout_and_fresh_suites_never_share_an_item_with_training_draws(name, levels):
    from posttrain.config import GeneratedSuite

    fixed = generated_suite(GeneratedSuite(domain=name, levels=levels, n=30, seed=0))
    fresh = fresh_draw(fixed, name, levels, seed=12345)
    fixed_keys = {t.metadata["problem_key"] for t in fixed.tasks}
    fresh_keys = {t.metadata["problem_key"] for t in fresh.tasks}
    assert len(fixed_keys) == 30 and len(fresh_keys) == len(fresh.tasks) >= 25
    assert not fixed_keys & fresh_keys  # the fresh draw is new items, not the fixed set again
    for seed in (0, 1, 2):
        train = sample_tasks(get_domain(name), 300, level=levels, split="train", seed=seed)
        assert not (fixed_keys | fresh_keys) & {t.metadata["problem_key"] for t in train}
    assert all(row["outside_heldout"] == 0 for row in hygiene([fixed, fresh]))


def test_hygiene_flags_a_training_item_in_a_heldout_suite():
    source = get_domain("arithmetic")
    train = sample_tasks(source, 3, level=2, split="train", seed=0)
    heldout = sample_tasks(source, 5, level=2, split="heldout", seed=0)
    (row,) = hygiene([tasks_suite("arithmetic", heldout + train[:1])])
    assert row["items"] == 6 and row["outside_heldout"] == 1 and row["examples"] == [train[0].metadata["problem_key"]]


def test_build_suites_generated_fresh_dataset_regression(tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"What is {i}+{i}?", "answer": str(2 * i)}) for i in range(7)))
    regression = tmp_path / "regression.jsonl"
    tasks = sample_tasks(get_domain("arithmetic"), 4, level=1, split="heldout", seed=9)
    regression.write_text("\n".join(json.dumps(t.to_dict()) for t in tasks) + "\n")
    recipe = _recipe(tmp_path, suites={
        "generated": [{"domain": "arithmetic", "levels": [2], "n": 10}, {"domain": "safety", "n": 6, "name": "safe"}],
        "datasets": [{"name": "qa", "path": str(data), "args": {"verifier": "math"}, "limit": 5}],
        "regression": [{"name": "past", "path": str(regression), "min_pass_rate": 0.5}],
    }, fresh_draw={"seed": 77})
    suites = build_suites(recipe)
    assert [(s.name, s.kind, s.group, len(s.tasks)) for s in suites] == [
        ("arithmetic", "heldout", "arithmetic", 10), ("arithmetic (fresh)", "fresh", "arithmetic", 10),
        ("safe", "heldout", "safe", 6), ("safe (fresh)", "fresh", "safe", 6),
        ("qa", "dataset", "qa", 5), ("past", "regression", "past", 4)]
    assert suites[1].seed == 77 and suites[-1].min_pass_rate == 0.5
    assert [t.id for t in suites[-1].tasks] == [t.id for t in tasks]
    again = build_suites(recipe)
    assert [t.id for t in again[1].tasks] == [t.id for t in suites[1].tasks]  # a fixed fresh seed repeats

    regression.write_text("{not json\n")
    with pytest.raises(EvalError, match="regression.jsonl:1"):
        build_suites(recipe)


def test_recipe_errors_name_the_field(tmp_path):
    from posttrain.config import ConfigError, load_recipe

    path = tmp_path / "eval.yaml"
    path.write_text("stage: eval\ncheckpoints: [a/final, b/final]\nsampling: {n: 2, k: [4]}\n")
    with pytest.raises(ConfigError, match="every k must be in 1..n"):
        load_recipe(path)
    path.write_text("stage: eval\ncheckpoints: [runs/x/final, other/x/final]\n")
    with pytest.raises(ConfigError, match="labels must differ"):
        load_recipe(path)
    path.write_text("stage: eval\ncheckpoints: [runs/sft/final]\nsuites: {generated: [{domian: arithmetic}]}\n")
    with pytest.raises(ConfigError, match="domian"):
        load_recipe(path)


def _write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_contamination_finds_exact_prompts_and_ngrams_and_excludes(tmp_path, tiny_tokenizer):
    source = get_domain("arithmetic")
    heldout = tasks_suite("arithmetic", sample_tasks(source, 20, level=3, split="heldout", seed=0))
    train = sample_tasks(source, 30, level=3, split="train", seed=0)
    long_text = "The invoice total is $1,234.50 and it was paid on 12 March 2024 by bank transfer from account 4412."
    docs = tasks_suite("docs", [Task(
        id="doc-1", domain="docs", messages=[{"role": "user", "content": f"Read: {long_text} What was paid?"}],
        verifier="exact", verifier_args={"answer": "1234.50"})], kind="dataset")

    sft = [source.demonstration(t).to_dict() for t in train] + [source.demonstration(heldout.tasks[3]).to_dict()]
    pairs = [{"prompt": f"Summarise: {long_text}", "chosen": "Paid.", "rejected": "Unpaid."}]
    episodes = tmp_path / "rl"
    episodes.mkdir()
    _write_jsonl(episodes / "episodes.jsonl", [
        {"task_id": heldout.tasks[5].id, "domain": "arithmetic", "messages": [*heldout.tasks[5].messages,
                                                                              {"role": "assistant", "content": "1"}]},
        {"task_id": heldout.tasks[5].id, "domain": "arithmetic", "messages": heldout.tasks[5].messages},
    ])
    recipe = _recipe(tmp_path, contamination={
        "sft": [{"path": _write_jsonl(tmp_path / "sft.jsonl", sft)}],
        "preferences": [{"path": _write_jsonl(tmp_path / "pairs.jsonl", pairs)}],
        "rl_episodes": [str(episodes)]})
    samples = training_samples(recipe.contamination)
    assert len(samples) == 31 + 1 + 1  # the RL task appears once

    report = check_contamination([heldout, docs], samples, tiny_tokenizer, ngram=13)
    flagged = {(row["suite"], row["task_id"]): row for row in report["items"]}
    assert set(flagged) == {("arithmetic", heldout.tasks[3].id), ("arithmetic", heldout.tasks[5].id),
                            ("docs", "doc-1")}
    assert flagged[("arithmetic", heldout.tasks[3].id)]["reasons"] == ["exact_prompt", "same_problem"]
    assert flagged[("arithmetic", heldout.tasks[5].id)]["reasons"] == ["exact_prompt", "same_problem"]
    assert flagged[("docs", "doc-1")]["reasons"] == ["ngram"]
    assert flagged[("docs", "doc-1")]["training"][0]["source"] == "pairs.jsonl"
    assert flagged[("arithmetic", heldout.tasks[5].id)]["training"][0]["source"] == "rl/episodes.jsonl"
    assert report["count"] == 3 and report["eval_items"] == 21 and report["by_suite"] == {"arithmetic": 2, "docs": 1}

    contaminated = {heldout.tasks[3].id, heldout.tasks[5].id}
    exclude_contaminated([heldout, docs], report)
    assert len(heldout.tasks) == 18 and not docs.tasks and report["excluded"]
    assert set(heldout.excluded) == contaminated and not contaminated & {t.id for t in heldout.tasks}
    assert check_contamination([heldout], [], tiny_tokenizer)["count"] == 0


def test_templated_siblings_are_not_contamination_but_a_reworded_problem_is(tiny_tokenizer):
    source = get_domain("safety")
    heldout = tasks_suite("safety", sample_tasks(source, 80, level=[1, 2, 3], split="heldout", seed=0))
    train = [source.demonstration(t) for t in sample_tasks(source, 1500, level=[1, 2, 3], split="train", seed=0)]
    assert check_contamination([heldout], train, tiny_tokenizer)["count"] == 0  # long shared n-grams, other problems

    target = heldout.tasks[0]
    leaked = source.demonstration(target)  # the same problem, worded differently: its task id gives it away
    leaked.messages[0] = {"role": "user", "content": "Hi! " + target.prompt.lower()}
    report = check_contamination([heldout], [*train, leaked], tiny_tokenizer)
    assert [(row["task_id"], row["reasons"]) for row in report["items"]] == [(target.id, ["same_problem"])]
