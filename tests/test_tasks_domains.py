"""Every generated domain: held-out hygiene, demonstrations that pass their own verifier, wrong answers that fail."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_envs_scripted import ScriptedEngine, demo_turns
from test_envs_tools import needs_bwrap

from posttrain.envs import rollout_episode
from posttrain.tasks import DOMAINS, TaskError, get_domain, sample_tasks, split_of
from posttrain.types import FailureClass, SamplingParams, Task
from posttrain.verify import check_task, verify

# (domain, levels, tasks drawn per level for the overlap check)
GENERATED = [
    ("arithmetic", [1, 2, 3], 60),
    ("extraction", [1, 2, 3], 200),
    ("calculator", [1, 2, 3, 4, 5], 200),
    ("code", [1, 2, 3], 40),
    ("repo_fix", [1, 2, 3], 60),
    ("long_doc_qa", [1, 3, 5], 60),
    ("needle", [1, 3, 5], 60),
    ("multi_doc_qa", [1, 2, 3], 60),
    ("reasoning_gym/basic_arithmetic", [1, 2], 100),
    ("reasoning_gym/word_sorting", [1, 2], 60),
]
SINGLE_TURN_FAST = ["arithmetic", "extraction", "long_doc_qa", "needle", "multi_doc_qa"]


@pytest.mark.parametrize("name,levels,count", GENERATED)
def test_train_and_heldout_never_overlap(name, levels, count):
    source = get_domain(name)
    for level in levels:
        heldout = sample_tasks(source, max(1, count // 10), level=level, split="heldout", seed=0)
        keys = {t.metadata["problem_key"] for t in heldout}
        for seed in (0, 1):
            train = sample_tasks(source, count, level=level, split="train", seed=seed)
            assert not keys & {t.metadata["problem_key"] for t in train}
            assert all(t.metadata["split"] == "train" and t.difficulty == level for t in train)
        assert all(split_of(key) == "heldout" for key in keys)


@pytest.mark.parametrize("name,levels,count", GENERATED)
def test_tasks_are_well_formed_and_serializable(name, levels, count):
    source = get_domain(name)
    for task in sample_tasks(source, 3, level=levels, seed=2):
        check_task(task)  # the verifier exists and accepts the arguments
        assert task.domain == source.name and task.id.startswith(source.name)
        assert Task.from_dict(json.loads(json.dumps(task.to_dict()))) == task
    again = sample_tasks(source, 3, level=levels, seed=2)
    assert [t.id for t in again] == [t.id for t in sample_tasks(source, 3, level=levels, seed=2)]


@pytest.mark.parametrize("name", SINGLE_TURN_FAST)
def test_single_turn_demonstrations_pass_and_wrong_answers_fail(name):
    source = get_domain(name)
    for task in sample_tasks(source, 12, level=range(1, source.max_level + 1), seed=3):
        sample = source.demonstration(task)
        assert sample.messages[: len(task.messages)] == task.messages
        assert sample.metadata.domain == name and sample.metadata.difficulty == task.difficulty
        answer = sample.messages[-1]["content"]
        assert verify(task, answer).score == 1.0, (task.prompt, answer)
        assert not verify(task, _wrong(answer)).passed


def _wrong(answer: str) -> str:
    """The demonstration's answer with its first digit changed (or, without digits, its first letter)."""
    for i, ch in enumerate(answer):
        if ch.isdigit():
            return answer[:i] + str((int(ch) + 1) % 10) + answer[i + 1:]
    for i, ch in enumerate(answer):
        if ch.isalpha():
            return answer[:i] + ("x" if ch != "x" else "y") + answer[i + 1:]
    raise AssertionError(answer)


def test_extraction_stays_small_enough_for_the_tiny_model(tiny_tokenizer):
    source = get_domain("extraction")
    for level in (1, 2, 3):
        for task in sample_tasks(source, 20, level=level, seed=4):
            answer = json.loads(source.demonstration(task).messages[-1]["content"])
            keys = list(task.verifier_args["schema"]["properties"])
            assert list(answer) == keys and len(keys) == level + 1  # asked order, 2-4 keys by level
            assert all(value in task.verifier_args["source"] for value in answer.values())  # copied verbatim
            assert task.verifier_args["source"].count(".") <= 3
            assert len(tiny_tokenizer.encode(task.prompt)) < 160


def test_extraction_scores_partial_fields():
    task = sample_tasks(get_domain("extraction"), 1, level=3, seed=5)[0]
    reference = dict(task.verifier_args["reference"])
    first = next(iter(reference))
    reference[first] = "nobody"
    assert verify(task, json.dumps(reference)).score == pytest.approx(0.75)
    assert verify(task, "not json").failure is FailureClass.FORMAT


def replay(tokenizer, source, task: Task, sandbox=None):
    """Run `task`'s demonstration through its environment with a policy that replays the assistant turns."""
    sample = source.demonstration(task)
    tools = sample.metadata.extras.get("tools")
    engine = ScriptedEngine(tokenizer, demo_turns(tokenizer, sample.messages, tools))
    trajectory = asyncio.run(rollout_episode(engine, task, tokenizer, SamplingParams(max_new_tokens=4096),
                                             sandbox, max_context_tokens=100_000))
    return sample, trajectory


def test_calculator_demonstrations_replay_to_a_pass(tiny_tokenizer):
    source = get_domain("calculator")
    for task in sample_tasks(source, 10, level=range(1, 6), seed=6):
        sample, trajectory = replay(tiny_tokenizer, source, task)
        assert trajectory.reward.passed, trajectory.reward
        assert trajectory.messages == sample.messages  # the env answers exactly what the demonstration shows
        assert [m["role"] for m in sample.messages] == ["user", "assistant", "tool", "assistant"]
        assert tiny_tokenizer.decode(trajectory.token_ids) == tiny_tokenizer.apply_chat_template(
            sample.messages, tokenize=False)


def test_calculator_level_5_mixes_operations():
    task = sample_tasks(get_domain("calculator"), 1, level=5, seed=1)[0]
    assert any(op in task.metadata["expression"][5:] for op in "+-") and task.tools == ["calculator"]


def test_calculator_can_show_tool_schemas(tiny_tokenizer):
    source = get_domain("calculator", show_tool_schemas=True)
    task = sample_tasks(source, 1, level=1)[0]
    sample, trajectory = replay(tiny_tokenizer, source, task)
    assert trajectory.reward.passed and sample.metadata.extras["tools"][0]["function"]["name"] == "calculator"
    assert "You can call these tools" in tiny_tokenizer.decode(trajectory.token_ids[: trajectory.prompt_length])


@needs_bwrap
@pytest.mark.bwrap
def test_code_demonstrations_pass_and_hard_coding_the_examples_fails():
    source = get_domain("code")
    for task in sample_tasks(source, 6, level=[1, 2, 3], seed=7):
        sample = source.demonstration(task)
        assert verify(task, sample.messages[-1]["content"]).score == 1.0, task.metadata["solution"]
        cases = task.verifier_args["tests"]["cases"]
        name = task.verifier_args["tests"]["function"]
        table = {json.dumps(c["args"]): c["expected"] for c in cases[:2]}  # only what the prompt shows
        cheat = f"```python\nimport json\ndef {name}(*args):\n    return {table!r}.get(json.dumps(list(args)))\n```"
        reward = verify(task, cheat)
        assert not reward.passed and reward.score <= 0.2 + 1e-9


@needs_bwrap
@pytest.mark.bwrap
def test_every_code_family_reference_passes_its_own_cases():
    from posttrain.tasks.code import FAMILIES

    for family in FAMILIES:
        source = get_domain("code", families=[family.name])
        task = sample_tasks(source, 1, level=family.level, seed=3)[0]
        assert task.metadata["family"] == family.name
        reward = verify(task, source.demonstration(task).messages[-1]["content"])
        assert reward.score == 1.0, (family.name, reward.details)


def test_code_families_cover_every_level():
    source = get_domain("code")
    with pytest.raises(TaskError, match="unknown families"):
        get_domain("code", families=["quicksort"])
    for level in (1, 2, 3):
        task = sample_tasks(source, 1, level=level)[0]
        assert task.difficulty == level and "```python" in task.prompt
        assert len(task.verifier_args["tests"]["cases"]) == 10


def test_long_doc_qa_needs_several_pages():
    source = get_domain("long_doc_qa")
    for level in range(1, 6):
        task = sample_tasks(source, 1, level=level, seed=level)[0]
        assert task.metadata["pages"] == level + 2 and task.metadata["hops"] == level
        parts = [part for part in task.metadata["trace"].split("; ") if "(page" in part]
        pages_cited = {part.split("(page ")[1].split(")")[0] for part in parts}
        assert len(pages_cited) == min(level, 3)
        assert task.prompt.count("--- Page") == level + 2


def test_every_domain_is_registered():
    assert {"arithmetic", "extraction", "calculator", "code", "repo_fix", "long_doc_qa", "needle", "multi_doc_qa",
            "dataset", "reasoning_gym"} <= set(DOMAINS)


def _episode(tokenizer, task: Task, text: str, **kwargs):
    engine = ScriptedEngine(tokenizer, [text + "<|end|>"])
    sampling = SamplingParams(max_new_tokens=kwargs.pop("max_new_tokens", 2048))
    return asyncio.run(rollout_episode(engine, task, tokenizer, sampling, max_context_tokens=100_000, **kwargs))


def test_long_doc_qa_episodes(tiny_tokenizer):
    source = get_domain("long_doc_qa")
    task = sample_tasks(source, 1, level=4, seed=9)[0]
    answer = task.metadata["answer"]
    assert _episode(tiny_tokenizer, task, f"Summing up: \\boxed{{{answer}}}").reward.passed
    wrong = _episode(tiny_tokenizer, task, f"\\boxed{{{int(answer) + 1}}}")
    assert wrong.reward.failure is FailureClass.WRONG_ANSWER
    hedged = _episode(tiny_tokenizer, task, f"It is \\boxed{{{answer}}} or \\boxed{{{int(answer) + 1}}}")
    assert not hedged.reward.passed
    cut = _episode(tiny_tokenizer, task, "Let me add the figures one by one: " * 20, max_new_tokens=30)
    assert cut.truncated and cut.reward.failure is FailureClass.TRUNCATED


def test_calculator_wrong_final_answer_fails(tiny_tokenizer):
    source = get_domain("calculator")
    task = sample_tasks(source, 1, level=4, seed=9)[0]
    sample = source.demonstration(task)
    turns = demo_turns(tiny_tokenizer, sample.messages)
    turns[-1] = turns[-1].replace(task.metadata["answer"], str(int(task.metadata["answer"]) + 10))
    engine = ScriptedEngine(tiny_tokenizer, turns)
    trajectory = asyncio.run(rollout_episode(engine, task, tiny_tokenizer, SamplingParams(max_new_tokens=256)))
    assert trajectory.tool_calls_ok == 1 and trajectory.reward.failure is FailureClass.WRONG_ANSWER


@needs_bwrap
@pytest.mark.bwrap
def test_code_episodes_success_and_failures(tiny_tokenizer):
    source = get_domain("code", families=["affine"])
    task = sample_tasks(source, 1, level=1, seed=9)[0]
    good = _episode(tiny_tokenizer, task, source.demonstration(task).messages[-1]["content"])
    assert good.reward.passed and good.reward.details["passed"] == 10
    loops = _episode(tiny_tokenizer, task, "```python\ndef affine(xs):\n    while True:\n        pass\n```")
    assert loops.reward.score == 0 and loops.reward.failure is FailureClass.TIMEOUT
    syntax = _episode(tiny_tokenizer, task, "```python\ndef affine(xs) return xs\n```")
    assert syntax.reward.score == 0 and syntax.reward.failure is FailureClass.WRONG_ANSWER
    prose = _episode(tiny_tokenizer, task, "I would use a list comprehension.")
    assert prose.reward.failure is FailureClass.FORMAT


def test_dataset_episodes(tiny_tokenizer, tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text(json.dumps({"question": "What is 6 times 7?", "answer": "#### 42"}) + "\n")
    task = get_domain("dataset", path=str(path), answer_format="gsm8k").tasks()[0]
    assert _episode(tiny_tokenizer, task, "6 * 7 = 42, so the answer is \\boxed{42}.").reward.passed
    assert _episode(tiny_tokenizer, task, "\\boxed{48}").reward.failure is FailureClass.WRONG_ANSWER
    assert _episode(tiny_tokenizer, task, "no idea").reward.failure is FailureClass.FORMAT
