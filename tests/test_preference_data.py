"""Preference pairs: validation errors that name file, line and field; skip-and-count; tokenization; batches."""

import json

import pytest
import torch

from posttrain.config import DataSource, PreferenceDataConfig
from posttrain.data import DataError
from posttrain.data.preference import (
    collate_pairs,
    load_preference_data,
    read_preference_pairs,
    tokenize_pair,
    tokenize_pairs,
    validate_pair_record,
)

GOOD = {"prompt": [{"role": "user", "content": "12+34"}], "chosen": {"role": "assistant", "content": "46"},
        "rejected": {"role": "assistant", "content": "45"}, "metadata": {"domain": "arithmetic", "difficulty": 2}}


def write_jsonl(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_record_forms_and_metadata():
    pair = validate_pair_record(GOOD, default_source="file")
    assert pair.chosen == [{"role": "assistant", "content": "46"}]
    assert pair.metadata.domain == "arithmetic" and pair.metadata.difficulty == 2 and pair.metadata.source == "file"
    short = validate_pair_record({"prompt": "12+34", "chosen": "46", "rejected": "45"})
    assert short.prompt == [{"role": "user", "content": "12+34"}] and short.rejected[0]["role"] == "assistant"
    multi = validate_pair_record({**GOOD, "rejected": [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calc", "arguments": {}}}]},
        {"role": "tool", "content": "46"}, {"role": "assistant", "content": "46!"}]})
    assert [m["role"] for m in multi.rejected] == ["assistant", "tool", "assistant"]


@pytest.mark.parametrize("record, message", [
    ({**GOOD, "chosen": None}, "chosen: missing"),
    ({**GOOD, "rejected": {"role": "user", "content": "x"}}, "rejected.role: a response holds assistant"),
    ({**GOOD, "rejected": [{"role": "tool", "content": "1"}]}, r"rejected\[0\].role: a response starts"),
    ({**GOOD, "prompt": [{"role": "user", "content": 3}]}, r"prompt\[0\].content: expected a string"),
    ({**GOOD, "prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
     r"prompt\[1\].role: the prompt must not end"),
    ({**GOOD, "rejected": GOOD["chosen"]}, "rejected: identical to chosen"),
    ({**GOOD, "metadata": {"difficulty": "hard"}}, "metadata.difficulty: expected a number"),
    ([1, 2], "<record>: expected an object"),
])
def test_invalid_records_name_the_field(record, message):
    from posttrain.data import RecordError

    with pytest.raises(RecordError, match=message):
        validate_pair_record(record)


def test_reader_errors_name_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [GOOD, "", {**GOOD, "chosen": {"role": "assistant"}}])
    with pytest.raises(DataError, match=rf"^{path}:3: chosen.content: missing$"):
        read_preference_pairs(DataSource(path=str(path)))
    path = write_jsonl(tmp_path / "broken.jsonl", [GOOD, '{"prompt": '])
    with pytest.raises(DataError, match=rf"{path}:2: malformed JSON"):
        read_preference_pairs(DataSource(path=str(path)))
    with pytest.raises(DataError, match="missing.jsonl: no such file"):
        read_preference_pairs(DataSource(path=str(tmp_path / "missing.jsonl")))


def test_skip_counts_and_writes_rejects(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [GOOD, {**GOOD, "rejected": None}, "not json", GOOD])
    config = PreferenceDataConfig(train=[DataSource(path=str(path))], on_invalid="skip")
    data = load_preference_data(config, rejects_dir=tmp_path / "run")
    assert len(data.train) == 2 and data.report["rejected"] == 2
    rejects = [json.loads(line) for line in (tmp_path / "run" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["file"], r["line"]) for r in rejects] == [(str(path), 2), (str(path), 3)]
    assert rejects[0]["error"] == "rejected: missing" and rejects[0]["raw"]["prompt"] == GOOD["prompt"]
    assert data.train[1].origin == f"{path}:4"


def test_parquet_and_heldout_split(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{**GOOD, "prompt": f"{i}+1", "chosen": str(i + 1), "rejected": str(i + 2), "metadata": {"domain": "count"}}
               for i in range(200)]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "pairs.parquet")
    config = PreferenceDataConfig(train=[DataSource(path=str(tmp_path / "pairs.parquet"))], heldout_fraction=0.2)
    data = load_preference_data(config)
    assert len(data.train) + len(data.heldout) == 200 and 20 < len(data.heldout) < 60
    assert not {p.prompt_text for p in data.train} & {p.prompt_text for p in data.heldout}
    assert data.train[0].metadata.source == "pairs.parquet"
    records[7]["rejected"] = records[7]["chosen"]
    pq.write_table(pa.Table.from_pylist(records[:10]), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet:row 7: rejected: identical to chosen"):
        load_preference_data(PreferenceDataConfig(train=[DataSource(path=str(tmp_path / "bad.parquet"))]))


def test_tokenization_scores_only_assistant_tokens(tiny_tokenizer):
    pair = validate_pair_record({**GOOD, "rejected": [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calculator",
                                                                            "arguments": {"expression": "12+34"}}}]},
        {"role": "tool", "content": "46"}, {"role": "assistant", "content": "46"}]})
    tokens = tokenize_pair(pair, tiny_tokenizer, max_length=512)
    decode = tiny_tokenizer.decode
    prompt = tokens.prompt_length
    assert decode(tokens.chosen_ids[:prompt]) == "<|user|>12+34<|end|><|assistant|>"
    assert tokens.rejected_ids[:prompt] == tokens.chosen_ids[:prompt]
    assert decode(tokens.chosen_ids[prompt:]) == "46<|end|>" and tokens.chosen_mask == [0] * prompt + [1, 1, 1]
    scored = decode([t for t, m in zip(tokens.rejected_ids, tokens.rejected_mask) if m])
    context = decode([t for t, m in zip(tokens.rejected_ids[prompt:], tokens.rejected_mask[prompt:]) if not m])
    assert context == "<|tool|>46<|end|><|assistant|>"
    assert scored.startswith("<tool_call>") and scored.endswith("</tool_call><|end|>46<|end|>")
    full = tiny_tokenizer.apply_chat_template(pair.prompt + pair.rejected, tokenize=False)
    assert decode(tokens.rejected_ids) == full


def test_assistant_turns_inside_the_prompt_are_not_scored(tiny_tokenizer):
    pair = validate_pair_record({**GOOD, "prompt": [{"role": "user", "content": "1+1"},
                                                    {"role": "assistant", "content": "2"},
                                                    {"role": "user", "content": "12+34"}]})
    tokens = tokenize_pair(pair, tiny_tokenizer, max_length=512)
    assert sum(tokens.chosen_mask) == 3 and not any(tokens.chosen_mask[: tokens.prompt_length])


def test_truncation_and_prompts_too_long(tiny_tokenizer):
    pair = validate_pair_record({**GOOD, "chosen": "4" * 40})
    tokens = tokenize_pair(pair, tiny_tokenizer, max_length=20)
    assert tokens.truncated and len(tokens.chosen_ids) == 20 and len(tokens.rejected_ids) < 20
    pair.origin = "pairs.jsonl:7"
    with pytest.raises(DataError, match=r"pairs.jsonl:7: prompt: \d+ tokens leave no room .* data.max_length=8"):
        tokenize_pairs([pair], tiny_tokenizer, max_length=8)
    kept, _, _ = tokenize_pairs([pair], tiny_tokenizer, max_length=8, on_invalid="skip")
    assert kept == []


def test_collate_puts_chosen_then_rejected_right_padded(tiny_tokenizer):
    pairs = [tokenize_pair(validate_pair_record(r), tiny_tokenizer, 512)
             for r in (GOOD, {**GOOD, "prompt": "1+1", "chosen": "2", "rejected": "11111"})]
    batch = collate_pairs(pairs, tiny_tokenizer.pad_token_id, max_groups=1)
    (group,) = batch["groups"]
    rows = group["input_ids"]
    assert rows.shape[0] == 4 and batch["num_pairs"] == 2 and group["rows"].tolist() == [1, 0, 2, 3]  # by length
    sequences = [pairs[0].chosen_ids, pairs[1].chosen_ids, pairs[0].rejected_ids, pairs[1].rejected_ids]
    for i, row in enumerate(group["rows"].tolist()):
        assert rows[i, : len(sequences[row])].tolist() == sequences[row]
        assert (rows[i, len(sequences[row]):] == tiny_tokenizer.pad_token_id).all()
        assert group["last_index"][i] == len(sequences[row]) - 1
    assert batch["token_counts"].tolist() == [3, 2, 3, 6]  # digits + <|end|> per response
    assert torch.equal(group["targets"], rows[:, 1:][group["select"]])
    assert sorted(group["row_index"].tolist()) == [0] * 3 + [1] * 2 + [2] * 3 + [3] * 6


def test_length_groups_cut_where_padding_is_saved():
    from posttrain.data.preference import length_groups

    assert length_groups([30] * 8 + [40] * 8, overhead_tokens=0) == [list(range(8)), list(range(8, 16))]
    assert length_groups([30] * 8 + [40] * 8, overhead_tokens=100) == [list(range(16))]  # saves only 80
    groups = length_groups([5, 50, 6, 51, 100, 7, 52, 101], overhead_tokens=0, max_groups=3)
    assert sorted(map(sorted, groups)) == [[0, 2, 5], [1, 3, 6], [4, 7]]
    assert length_groups([9, 9, 9]) == [[0, 1, 2]]


def test_flywheel_pairs_read_as_preference_pairs(tmp_path, tiny_tokenizer):
    """Pairs the data flywheel writes from verified episodes are valid records of this format."""
    from posttrain.data.flywheel import episodes_to_pairs, write_records

    def episode(answer, passed, failure):
        return {"task_id": "t1", "domain": "arithmetic", "difficulty": 2, "passed": passed, "failure": failure,
                "messages": [{"role": "user", "content": "12+34"}, {"role": "assistant", "content": answer}]}

    records = episodes_to_pairs([episode("46", True, "none"), episode("45", False, "wrong_answer"),
                                 episode("", False, "infra")])
    write_records(tmp_path / "pairs.jsonl", records)
    data = load_preference_data(PreferenceDataConfig(train=[DataSource(path=str(tmp_path / "pairs.jsonl"))]))
    (pair,) = data.train
    assert pair.chosen[0]["content"] == "46" and pair.rejected[0]["content"] == "45"
    assert pair.metadata.extras["rejected_failure"] == "wrong_answer"
    assert tokenize_pairs(data.train, tiny_tokenizer, 64)[1][0].chosen_mask[-3:] == [1, 1, 1]
