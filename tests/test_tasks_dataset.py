"""The dataset adapter (JSONL and saved Hugging Face datasets) and the reasoning-gym domains."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_envs_scripted import ScriptedEngine
from test_envs_tools import needs_bwrap

from posttrain.envs import rollout_episode
from posttrain.tasks import DOMAINS, TaskError, get_domain, reasoning_gym_names, sample_tasks
from posttrain.tasks.dataset import last_boxed
from posttrain.types import FailureClass, SamplingParams
from posttrain.verify import verify

GSM8K = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
     "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A box holds 12 eggs. How many eggs are in 5 boxes?", "answer": "12 * 5 = <<12*5=60>>60\n#### 60"},
    {"question": "Sara earns $1,200 a week. How much in 2 weeks?", "answer": "1,200 * 2 = 2,400\n#### 2,400"},
]
MATH = [
    {"problem": "Compute $\\frac{1}{2}+\\frac{1}{3}$.", "solution": "We get $\\boxed{\\frac{5}{6}}$.",
     "level": "Level 2"},
    {"problem": "What is $2^{10}$?", "solution": "$2^{10} = \\boxed{1024}$", "level": "Level 1"},
    {"problem": "Solve $x+1=3$.", "solution": "So $x = \\boxed{2}$.", "level": "Level 1"},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_gsm8k_jsonl(tmp_path):
    source = get_domain("dataset", path=write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K), domain_name="gsm8k",
                        answer_format="gsm8k")
    tasks = source.tasks()
    assert [t.verifier_args["reference"] for t in tasks] == ["7", "60", "2400"]
    assert tasks[0].metadata["solution"] == "He has 3 + 4 = 7 apples."
    assert tasks[0].domain == "gsm8k" and tasks[0].verifier == "math" and source.max_level == 1
    for task in tasks:
        sample = source.demonstration(task)
        assert sample.metadata.reasoning_trace and verify(task, sample.messages[-1]["content"]).passed
        assert not verify(task, "The answer is \\boxed{13}.").passed
    assert {t.metadata["problem_key"] for t in source.tasks("train")}.isdisjoint(
        {t.metadata["problem_key"] for t in source.tasks("heldout")})
    drawn = sample_tasks(source, 2, level=1, split="train", heldout_fraction=0.0)
    assert len({t.id for t in drawn}) == 2


def test_math_saved_hf_dataset_with_levels(tmp_path):
    from datasets import Dataset

    Dataset.from_list(MATH).save_to_disk(str(tmp_path / "math"))
    source = get_domain("dataset", path=str(tmp_path / "math"), question_field="problem",
                        answer_field="solution", answer_format="boxed", level_field="level")
    assert source.max_level == 2 and sorted(source.by_level) == [1, 2]
    [task] = sample_tasks(source, 1, level=2, heldout_fraction=0.0)
    assert task.verifier_args["reference"] == "\\frac{5}{6}" and task.difficulty == 2
    assert verify(task, "so it is \\boxed{5/6}").passed
    assert verify(task, source.demonstration(task).messages[-1]["content"]).passed


def test_dataset_errors_name_file_line_and_field(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps(GSM8K[0]) + "\n{not json\n")
    with pytest.raises(TaskError, match=r"bad.jsonl:2: malformed JSON"):
        get_domain("dataset", path=str(bad_json), answer_format="gsm8k")
    missing = write_jsonl(tmp_path / "missing.jsonl", [GSM8K[0], {"questoin": "x", "answer": "1"}])
    with pytest.raises(TaskError, match=r"missing.jsonl:2: field 'question' missing \(did you mean 'questoin'\?\)"):
        get_domain("dataset", path=missing)
    no_marker = write_jsonl(tmp_path / "plain.jsonl", [{"question": "q", "answer": "42"}])
    with pytest.raises(TaskError, match=r"plain.jsonl:1: field 'answer' has no '#### <answer>' line"):
        get_domain("dataset", path=no_marker, answer_format="gsm8k")
    empty_answer = write_jsonl(tmp_path / "empty.jsonl", [{"question": "q", "answer": ""}])
    with pytest.raises(TaskError, match=r"empty.jsonl:1: field 'answer' must be a non-empty string"):
        get_domain("dataset", path=empty_answer)
    with pytest.raises(TaskError, match="no such file"):
        get_domain("dataset", path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(TaskError, match="answer_format"):
        get_domain("dataset", path=no_marker, answer_format="latex")
    numbers = write_jsonl(tmp_path / "numbers.jsonl", [{"question": "1+1?", "answer": 2}])
    assert get_domain("dataset", path=numbers).tasks()[0].verifier_args["reference"] == "2"


def test_last_boxed_balances_braces():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed("no box") is None and last_boxed("\\boxed{open") is None


def test_every_reasoning_gym_generator_is_a_domain():
    names = reasoning_gym_names()
    assert len(names) >= 100 and "basic_arithmetic" in names
    source = get_domain("reasoning_gym/basic_arithmetic")  # registers every generator on first use
    assert {f"reasoning_gym/{n}" for n in names} <= set(DOMAINS)
    assert source.name == "reasoning_gym/basic_arithmetic" and source.max_level > 1
    assert get_domain("reasoning_gym", dataset="word_sorting").name == "reasoning_gym/word_sorting"
    with pytest.raises(TaskError, match="did you mean 'basic_arithmetic'"):
        get_domain("reasoning_gym", dataset="basic_arithmetik")


def test_reasoning_gym_levels_follow_the_curriculum():
    source = get_domain("reasoning_gym/basic_arithmetic")
    easy = sample_tasks(source, 20, level=1, seed=1)
    hard = sample_tasks(source, 20, level=source.max_level, seed=1)
    length = lambda tasks: sum(len(t.verifier_args["entry"]["metadata"]["expression"]) for t in tasks)  # noqa: E731
    assert length(hard) > length(easy)
    assert easy[0].messages[0]["role"] == "system" and "<answer>" in easy[0].messages[0]["content"]
    fixed = get_domain("reasoning_gym/basic_arithmetic", config={"min_terms": 2, "max_terms": 2})
    assert fixed.max_level == 1


@needs_bwrap
@pytest.mark.bwrap
@pytest.mark.parametrize("name", [
    "basic_arithmetic", "word_sorting",
    *[pytest.param(n, marks=pytest.mark.slow) for n in ("gcd", "letter_counting", "number_sorting", "spell_backward")],
])
def test_reasoning_gym_demonstrations_pass_and_wrong_answers_fail(name, tiny_tokenizer):
    source = get_domain(f"reasoning_gym/{name}")
    for task in sample_tasks(source, 2, level=[1, source.max_level], seed=2):
        answer = source.demonstration(task).messages[-1]["content"]
        assert verify(task, answer).score == 1.0, (task.prompt, answer)
        assert not verify(task, "<answer>definitely wrong 12345</answer>").passed
    # End to end in the single-turn env.
    engine = ScriptedEngine(tiny_tokenizer, [answer + "<|end|>"])
    trajectory = asyncio.run(rollout_episode(engine, task, tiny_tokenizer, SamplingParams(max_new_tokens=4096),
                                             max_context_tokens=100_000))
    assert trajectory.reward.passed and trajectory.reward.failure is FailureClass.NONE


def test_reasoning_gym_without_reference_answers_has_no_demonstrations():
    source = get_domain("reasoning_gym/graph_color")
    task = sample_tasks(source, 1, level=1)[0]
    with pytest.raises(TaskError, match="no reference answer"):
        source.demonstration(task)


def test_reasoning_gym_broken_curriculum_level_is_a_clear_error():
    source = get_domain("reasoning_gym/caesar_cipher")
    with pytest.raises(TaskError, match="cannot build level"):
        sample_tasks(source, 1, level=source.max_level)


@needs_bwrap
@pytest.mark.bwrap
@pytest.mark.slow
def test_every_reasoning_gym_generator_makes_tasks_whose_demonstrations_pass():
    no_reference, broken = [], []
    for name in reasoning_gym_names():
        source = get_domain(f"reasoning_gym/{name}")
        try:
            task = sample_tasks(source, 1, level=1, seed=0)[0]
        except TaskError:  # a generator whose curriculum cannot build even level 1 (reasoning-gym's own bug)
            broken.append(name)
            continue
        if task.metadata["answer"] is None:
            no_reference.append(name)
            continue
        assert verify(task, source.demonstration(task).messages[-1]["content"]).passed, name
    assert len(broken) <= 3, broken
    assert len(no_reference) <= 8, no_reference
