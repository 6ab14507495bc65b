"""Readers: JSONL, Parquet and saved datasets; errors name file, line and field; skipped records go to rejects."""

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain.config import DataSource
from posttrain.data import DataError, RejectLog, read_jsonl_records, read_records, read_samples

GOOD = {
    "messages": [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "46"}],
    "metadata": {"domain": "arithmetic", "difficulty": 2, "reasoning_trace": "2+4=6", "topic": "sums"},
}
TOOL = {
    "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {"c": "x"}}}]},
        {"role": "tool", "name": "w", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
}


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_jsonl_round_trip_keeps_metadata_and_defaults_source(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD, "", TOOL])
    samples = read_samples(DataSource(path=str(path)))
    assert len(samples) == 2
    assert samples[0].metadata.domain == "arithmetic" and samples[0].metadata.difficulty == 2
    assert samples[0].metadata.extras == {"topic": "sums"} and samples[0].metadata.source == "train.jsonl"
    assert samples[1].messages[1]["tool_calls"][0]["function"]["name"] == "w"
    named = read_samples(DataSource(path=str(path), source="mine"))
    assert named[1].metadata.source == "mine"


def test_invalid_role_names_file_line_and_field(tmp_path):
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD] * 16 + [bad])
    with pytest.raises(DataError) as error:
        read_samples(str(path))
    assert str(error.value) == (
        f"{path}:17: messages[1].role: expected one of system, user, assistant, tool, got 'bot'"
    )


def test_malformed_json_says_so_with_its_line(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD, '{"messages": [', GOOD])
    with pytest.raises(DataError, match=r"train\.jsonl:2: malformed JSON"):
        read_samples(str(path))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(DataError, match=r"nowhere\.jsonl: no such file"):
        read_samples(str(tmp_path / "nowhere.jsonl"))


def test_unknown_extension_asks_for_a_format(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("x")
    with pytest.raises(DataError, match="format"):
        read_samples(str(path))


def test_skip_writes_every_reject_with_file_line_error_and_raw(tmp_path):
    no_reply = {"messages": [{"role": "user", "content": "hi"}]}
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD, "not json", no_reply, [1, 2], GOOD])
    rejects_path = tmp_path / "out" / "rejects.jsonl"
    samples = read_samples(str(path), on_invalid="skip", rejects_path=rejects_path)
    assert len(samples) == 2
    rejects = [json.loads(line) for line in rejects_path.read_text().splitlines()]
    assert [r["line"] for r in rejects] == [2, 3, 4]
    assert rejects[0]["raw"] == "not json" and "malformed JSON" in rejects[0]["error"]
    assert rejects[1]["error"] == "messages: no assistant turn (nothing to train on)"
    assert rejects[1]["raw"] == no_reply and rejects[1]["file"] == str(path)


def test_skip_without_a_rejects_file_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD])
    with pytest.raises(DataError, match="rejects"):
        read_samples(str(path), on_invalid="skip")


def test_read_jsonl_records_is_reusable_for_other_schemas(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"chosen": "a"}, "", "oops", {"rejected": "b"}])
    log = RejectLog(tmp_path / "rejects.jsonl")
    with log:
        records = list(read_jsonl_records(path, on_invalid="skip", rejects=log))
    assert records == [(1, {"chosen": "a"}), (4, {"rejected": "b"})]
    assert log.count == 1 and log.counts == {str(path): 1}
    with pytest.raises(DataError, match=r"pairs\.jsonl:3: malformed JSON"):
        list(read_jsonl_records(path))


def test_parquet_rows_drop_arrow_nulls_and_report_row_numbers(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD, TOOL]), path)
    samples = read_samples(str(path))
    assert len(samples) == 2
    assert "tool_calls" not in samples[0].messages[1]  # Arrow filled it with null
    assert samples[1].metadata.extras == {}  # null topic/difficulty from the unified struct
    rows = [{"messages": GOOD["messages"]}, {"messages": [{"role": "bot", "content": "x"}]}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=r"train\.parquet:row 1: messages\[0\]\.role"):
        read_samples(str(path))


def test_saved_dataset_dict_needs_a_split_when_it_has_several(tmp_path):
    table = {"messages": [GOOD["messages"], TOOL["messages"]], "metadata": [GOOD["metadata"], {"domain": "tools"}]}
    dataset = datasets.Dataset.from_dict(table)
    datasets.DatasetDict({"train": dataset, "test": dataset.select([0])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match="split to one of test, train"):
        read_samples(DataSource(path=str(tmp_path / "dd")))
    assert len(read_samples(DataSource(path=str(tmp_path / "dd"), split="train"))) == 2
    dataset.save_to_disk(str(tmp_path / "single"))
    samples = read_samples(DataSource(path=str(tmp_path / "single"), format="hf_disk"))
    assert [s.metadata.domain for s in samples] == ["arithmetic", "tools"]
    assert [location for location, _ in read_records(tmp_path / "single")] == ["row 0", "row 1"]
