"""Long-context domains: needle in a haystack, multi-document QA and long-document QA up to 32k tokens.

Lengths are checked in the tokens of a real tokenizer (the built-in BPE, trained here on the domains' own text),
the answers against the real verifiers, and the making of a 32k-token task against the clock.
"""

from __future__ import annotations

import re
import time

import pytest
from test_schedule import ScriptedPolicy, producer, run_batches, schedule_drop

from posttrain.config.rl import DomainConfig
from posttrain.schedule import Scheduler
from posttrain.tasks import TaskError, filler_vocabulary, get_domain, sample_tasks
from posttrain.verify import verify


@pytest.fixture(scope="module")
def long_tokenizer():
    """The built-in tokenizer trained on the long-context domains' text (a 512-token vocabulary)."""
    from posttrain.models import train_tokenizer

    texts = list(filler_vocabulary())
    for name in ("needle", "multi_doc_qa"):
        texts += [t.prompt for t in sample_tasks(get_domain(name, lengths=[1024]), 20, level=1, seed=5)]
    return train_tokenizer(texts, vocab_size=512)


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("name,lengths", [("needle", [256, 1024, 4096]), ("multi_doc_qa", [512, 1024, 4096])])
def test_levels_are_lengths_in_the_tokenizers_tokens(name, lengths, long_tokenizer):
    source = get_domain(name, lengths=lengths, tokenizer=long_tokenizer)
    assert source.max_level == 3
    for level, length in enumerate(lengths, start=1):
        for task in sample_tasks(source, 3, level=level, seed=level):
            measured = _tokens(long_tokenizer, task.prompt)
            assert task.metadata["context_tokens"] == measured and task.metadata["tokens_exact"]
            assert task.metadata["length"] == length
            # The whole chat-rendered prompt fits the level's length with the reserve, and fills most of it.
            rendered = long_tokenizer.apply_chat_template(task.messages, tokenize=True, add_generation_prompt=True,
                                                          return_dict=True)["input_ids"]
            assert len(rendered) + 16 <= length and measured >= 0.85 * (length - 24), (level, measured)


def test_a_tokenizer_directory_counts_the_same(long_tokenizer, tmp_path):
    long_tokenizer.save_pretrained(tmp_path)
    by_object = sample_tasks(get_domain("needle", lengths=[512], tokenizer=long_tokenizer), 2, level=1)
    by_path = sample_tasks(get_domain("needle", lengths=[512], tokenizer=str(tmp_path)), 2, level=1)
    assert [t.prompt for t in by_object] == [t.prompt for t in by_path]
    with pytest.raises(TaskError, match="could not load"):
        get_domain("needle", tokenizer=str(tmp_path / "missing"))


def test_needle_depth_places_the_needle_and_only_its_key_answers():
    source = get_domain("needle", lengths=[2048], depths=[0.0, 0.5, 1.0], distractors=3)
    seen = set()
    for task in sample_tasks(source, 30, level=1, seed=1):
        meta = task.metadata
        seen.add(meta["depth"])
        assert abs(meta["needle_depths"][0] - meta["depth"]) < 0.03
        codes = re.findall(r"The secret code of (\w+) is (\d+)\.", task.prompt)
        assert len(codes) == 4 and dict(codes)[meta["keys"][0]] == meta["answer"]
        assert verify(task, meta["answer"]).passed
        others = [code for key, code in codes if key != meta["keys"][0]]
        assert not any(verify(task, code).passed for code in others)  # a distractor's code is wrong
    assert seen == {0.0, 0.5, 1.0}


def test_several_needles_are_spread_after_the_first_and_answered_in_order():
    source = get_domain("needle", lengths=[4096], depths=[0.25], needles=3, distractors=0)
    task = sample_tasks(source, 1, level=1, seed=4)[0]
    depths = task.metadata["needle_depths"]
    assert depths == sorted(depths) and abs(depths[0] - 0.25) < 0.03 and abs(depths[1] - 0.5) < 0.03
    assert abs(depths[2] - 0.75) < 0.03
    answer = task.metadata["answer"]
    assert verify(task, answer).passed and verify(task, f"  {answer}. ").passed
    assert not verify(task, ", ".join(reversed(answer.split(", ")))).passed
    assert not verify(task, answer.split(", ")[0]).passed


def test_multi_doc_answer_needs_two_or_three_documents():
    for hops in (2, 3):
        source = get_domain("multi_doc_qa", lengths=[2048], hops=hops)
        for task in sample_tasks(source, 5, level=1, seed=hops):
            documents = re.split(r"Document \d+:\n", task.prompt.split("\n\nQuestion:")[0])[1:]
            chain = task.metadata["chain"]
            person, firm, answer = chain[0], chain[1], task.metadata["answer"]
            assert answer == chain[-1] and task.metadata["documents"] == len(documents) > 6
            holding_person = [d for d in documents if d.startswith(f"{person} works")]
            assert len(holding_person) == 1 and answer not in holding_person[0]  # not answerable from one document
            assert firm in holding_person[0]
            assert [d for d in documents if d.startswith(f"{firm} has its headquarters in {chain[2]}.")]
            assert verify(task, answer).passed and verify(task, answer.upper()).passed
            assert not verify(task, firm).passed
            assert len(task.metadata["evidence_depths"]) == hops


def test_long_doc_qa_climbs_to_32k_tokens(long_tokenizer):
    lengths = [1024, 2048, 4096, 8192, 16384, 32768]
    source = get_domain("long_doc_qa", lengths=lengths, tokenizer=long_tokenizer)
    assert source.max_level == 6
    pages = []
    for level, length in enumerate(lengths, start=1):
        task = sample_tasks(source, 1, level=level, seed=level)[0]
        assert task.difficulty == level and task.metadata["hops"] == min(level, 5)
        assert 0.85 * length <= task.metadata["context_tokens"] <= length
        assert task.metadata["context_tokens"] == _tokens(long_tokenizer, task.prompt)
        assert verify(task, source.demonstration(task).messages[-1]["content"]).passed
        pages.append(task.metadata["pages"])
    assert pages == sorted(pages) and pages[-1] > 40
    # Without `lengths` the domain is what it was: five levels of L + 2 pages.
    assert get_domain("long_doc_qa").max_level == 5
    assert "length" not in sample_tasks(get_domain("long_doc_qa"), 1, level=2)[0].metadata


@pytest.mark.parametrize("name,args", [("needle", {"needles": 4}), ("multi_doc_qa", {"hops": 3}),
                                       ("long_doc_qa", {"lengths": [32768]})])
def test_a_32k_token_task_is_made_fast(name, args, long_tokenizer):
    defaults = {"needle": {}, "multi_doc_qa": {}, "long_doc_qa": {}}[name]
    source = get_domain(name, tokenizer=long_tokenizer, **{**defaults, **args})
    level = source.max_level
    sample_tasks(source, 1, level=level, seed=0)  # warm
    started = time.perf_counter()
    tasks = sample_tasks(source, 4, level=level, seed=1)
    per_task = (time.perf_counter() - started) / 4
    assert all(t.metadata["context_tokens"] > 28_000 for t in tasks)
    assert per_task < 0.5, f"{name}: {per_task:.2f} s per 32k-token task"


def test_bad_lengths_and_depths_name_the_problem():
    with pytest.raises(TaskError, match="must increase"):
        get_domain("needle", lengths=[1024, 512])
    with pytest.raises(TaskError, match="depths"):
        get_domain("needle", depths=[1.5])
    with pytest.raises(TaskError, match="cannot hold"):
        sample_tasks(get_domain("needle", lengths=[64], needles=8, distractors=8), 1, level=1)
    with pytest.raises(TaskError, match="hops"):
        get_domain("multi_doc_qa", hops=4)


def test_the_curriculum_climbs_lengths():
    """The scheduler's level controller moves a long-context domain from short to long documents as the
    (scripted) policy's reach grows, and the tasks it draws grow with the level."""
    lengths = [256, 512, 1024, 2048]
    drawn: dict[int, set[int]] = {}

    def pass_prob(task, step):
        drawn.setdefault(task.difficulty, set()).add(task.metadata["length"])
        reach = 256 * 2 ** (step / 8)  # the context the policy masters doubles every 8 batches
        return 0.97 if task.metadata["length"] <= reach else 0.05

    policy = ScriptedPolicy(pass_prob)
    config = schedule_drop(curriculum={"min_episodes": 32, "window": 64})
    scheduler = Scheduler([DomainConfig(name="needle", args={"lengths": lengths}, levels=[1, 2, 3, 4])], config,
                          seed=0)
    batches = run_batches(producer(policy, scheduler, prompts=8), policy, 0, 40)
    levels = [int(b.stats["schedule"]["curriculum/needle"]) for b in batches]
    assert levels[0] == 1 and levels[-1] == 4 and levels == sorted(levels)
    assert drawn == {level: {length} for level, length in enumerate(lengths, start=1)}


@pytest.fixture(scope="module")
def merging_tokenizer():
    """A BPE without a word-splitting pre-tokenizer: its merges cross spaces, so a text's count is not the sum of
    its pieces' and the domains must count each prompt whole."""
    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(filler_vocabulary()) + [t.prompt for t in sample_tasks(get_domain("needle", lengths=[512]), 10,
                                                                        level=1)]
    texts += [t.prompt for t in sample_tasks(get_domain("multi_doc_qa", lengths=[512]), 10, level=1)]
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")


@pytest.mark.parametrize("name", ["needle", "multi_doc_qa", "long_doc_qa"])
def test_a_tokenizer_whose_counts_do_not_add_up_is_counted_whole(name, merging_tokenizer):
    lengths = {"needle": [512, 1024], "multi_doc_qa": [512, 1024], "long_doc_qa": [1024, 2048]}[name]
    source = get_domain(name, lengths=lengths, tokenizer=merging_tokenizer)
    assert not source.counter.additive
    for level, length in enumerate(lengths, start=1):
        for task in sample_tasks(source, 2, level=level, seed=level):
            measured = _tokens(merging_tokenizer, task.prompt)
            # Exact and within the level; filled less than an additive tokenizer's (the pieces' counts overstate).
            assert task.metadata["context_tokens"] == measured <= length - 24 and measured > 0.4 * length
