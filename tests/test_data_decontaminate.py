"""Decontamination: token n-gram overlap and exact prompt match against eval sets; the reusable NgramIndex."""

import json

import pytest

from posttrain.data import (
    DataError,
    NgramIndex,
    SampleMetadata,
    SFTSample,
    decontaminate,
    ngram_hashes,
    read_eval_items,
)
from posttrain.models import train_tokenizer

QUESTION = "A train leaves the station at nine and travels sixty miles per hour for three hours; how far does it go"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([QUESTION, "What is the capital of France? Paris is the capital."] * 5)


def chat(user: str, reply: str = "ok", trace: str | None = None) -> SFTSample:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return SFTSample(messages, SampleMetadata(reasoning_trace=trace, source="train"))


def test_ngram_index_finds_shared_windows_only():
    index = NgramIndex(3)
    assert index.add([1, 2, 3, 4, 5], key="eval/0") == 3
    index.add([9, 9], key="short")  # shorter than n: nothing indexed
    assert len(index) == 3
    assert index.overlaps([7, 3, 4, 5, 8]) == ["eval/0"]
    assert index.overlaps([5, 4, 3, 2, 1]) == []
    assert index.overlaps([9, 9, 9]) == []
    assert index.overlaps_many([[2, 3, 4], [1, 2], []]) == [["eval/0"], [], []]


def test_ngram_hashes_distinguish_order_and_values():
    hashes = ngram_hashes([1, 2, 3, 1, 2, 3], 3).tolist()
    assert hashes[0] == hashes[3] and len(set(hashes)) == 3
    assert ngram_hashes([0, 0, 1], 2).tolist()[0] != ngram_hashes([0, 1], 2).tolist()[0]
    assert len(ngram_hashes([1, 2], 3)) == 0


def test_samples_overlapping_an_eval_item_are_removed_and_reported(tokenizer, tmp_path):
    path = tmp_path / "eval.jsonl"
    items = [
        {"id": "trains/1", "messages": [{"role": "user", "content": QUESTION + "?"}], "answer": "180 miles"},
        {"id": "capital", "prompt": "What is the capital of France?"},
    ]
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    eval_items = read_eval_items(str(path))
    samples = [
        chat("Solve: " + QUESTION + ", please.", "180 miles"),  # n-gram overlap (wrapped in other words)
        chat("what is the capital of   FRANCE?", "Paris"),  # exact prompt, after normalization
        chat("What is the capital of Spain?", "Madrid"),  # clean
        chat("Quick one.", "Sure.", trace="I recall: " + QUESTION),  # overlap hidden in the reasoning trace
    ]
    result = decontaminate(samples, eval_items, tokenizer, ngram=13)
    assert [s.messages[1]["content"] for s in result.samples] == ["What is the capital of Spain?"]
    report = result.report()
    assert report["removed"] == 3 and report["eval_items"] == 2 and report["ngram"] == 13
    by_sample = {c["sample"]: c for c in report["contaminated"]}
    assert by_sample[0]["reason"] == "ngram" and by_sample[0]["eval_items"] == ["trains/1"]
    assert by_sample[1]["reason"] == "exact_prompt" and by_sample[1]["eval_items"] == ["capital"]
    assert by_sample[3]["eval_items"] == ["trains/1"]


def test_nothing_to_check_against_keeps_everything(tokenizer):
    samples = [chat("a"), chat("b")]
    assert decontaminate(samples, [], tokenizer).samples == samples


def test_eval_items_without_messages_or_prompt_are_errors(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps({"question": "?"}) + "\n")
    with pytest.raises(DataError, match=r"eval\.jsonl:1: messages"):
        read_eval_items(str(path))
