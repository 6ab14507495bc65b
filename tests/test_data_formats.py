"""Record formats, column mappings, CSV and hub-style sources, bad files: every error names file and line."""

import json
import subprocess
import sys

import datasets
import pytest
import yaml

from posttrain.config import DataSource, PreferenceDataConfig
from posttrain.data import DataError, RejectLog, iter_samples, read_samples
from posttrain.data.packing import build_epoch
from posttrain.data.preference import load_preference_data, read_preference_pairs
from posttrain.data.tokenize import TokenizedSample

CHAT = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_openai_messages_with_text_parts_are_joined_and_other_parts_name_the_line(tmp_path):
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Add"}, {"type": "text", "text": "2+2"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "4"}]}]}
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                          {"role": "assistant", "content": "a cat"}]}
    path = write_jsonl(tmp_path / "parts.jsonl", [parts, {"messages": CHAT}, image])
    with pytest.raises(DataError) as error:
        read_samples(DataSource(path=str(path)))
    assert str(error.value).startswith(f"{path}:3: messages[0].content[0]: only text parts")
    assert "'image_url'" in str(error.value)
    samples = read_samples(DataSource(path=str(path)), "skip", RejectLog(None))
    assert samples[0].messages[0]["content"] == "Add\n2+2" and samples[0].messages[1]["content"] == "4"
    assert [s.metadata.origin for s in samples] == [f"{path}:1", f"{path}:2"]


def test_sharegpt_roles_map_to_chat_roles_and_tool_calls(tmp_path):
    record = {"system": "be brief", "conversations": [
        {"from": "human", "value": "weather in Oslo?"},
        {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Oslo"}})},
        {"from": "observation", "value": "rain"},
        {"from": "gpt", "value": "Rain."},
    ]}
    bad = {"conversations": [{"from": "robot", "value": "hi"}, {"from": "gpt", "value": "x"}]}
    path = write_jsonl(tmp_path / "sharegpt.jsonl", [record, bad])
    with pytest.raises(DataError, match=rf"{path}:2: conversations\[0\]\.from: expected one of human, user, gpt.*got .robot."):
        read_samples(DataSource(path=str(path)))
    sample = read_samples(DataSource(path=str(path)), "skip", RejectLog(None))[0]
    assert [m["role"] for m in sample.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert sample.messages[2]["tool_calls"][0]["function"] == {"name": "weather", "arguments": {"city": "Oslo"}}
    assert sample.messages[3]["content"] == "rain"


def test_prompt_completion_and_alpaca_records(tmp_path):
    strings = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+2?", "completion": "4"}])
    lists = write_jsonl(tmp_path / "pc_list.jsonl", [{"prompt": [{"role": "system", "content": "s"},
                                                                   {"role": "user", "content": "q"}],
                                                        "completion": [{"role": "assistant", "content": "[1, 2]"}]}])
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Sum", "input": "2 2", "output": "4"},
                                                     {"instruction": "Say hi", "output": "hi"}])
    assert read_samples(DataSource(path=str(strings)))[0].messages == CHAT
    assert [m["role"] for m in read_samples(DataSource(path=str(lists)))[0].messages] == ["system", "user", "assistant"]
    first, second = read_samples(DataSource(path=str(alpaca)))
    assert first.messages == [{"role": "user", "content": "Sum\n\n2 2"}, {"role": "assistant", "content": "4"}]
    assert second.messages[0]["content"] == "Say hi"


def test_an_ambiguous_record_names_file_and_line_and_record_format_settles_it(tmp_path):
    path = write_jsonl(tmp_path / "both.jsonl", [{"messages": CHAT, "instruction": "x", "output": "y"}])
    with pytest.raises(DataError, match=rf"{path}:1: the record fits several formats \(messages, alpaca\)"):
        read_samples(DataSource(path=str(path)))
    assert read_samples(DataSource(path=str(path), record_format="alpaca"))[0].messages[1]["content"] == "y"
    unknown = write_jsonl(tmp_path / "unknown.jsonl", [{"text": "hello"}])
    with pytest.raises(DataError, match=rf"{unknown}:1: <record>: no known format.*got text"):
        read_samples(DataSource(path=str(unknown)))


def test_a_later_record_in_another_format_is_an_error_naming_it(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"messages": CHAT}, {"instruction": "x", "output": "y"}])
    with pytest.raises(DataError, match=rf"{path}:2: messages: missing"):
        read_samples(DataSource(path=str(path)))


def test_column_and_metadata_mappings(tmp_path):
    path = write_jsonl(tmp_path / "mapped.jsonl", [{"dialog": CHAT, "category": "math", "level": 3, "lang": "en"}])
    source = DataSource(path=str(path), columns={"messages": "dialog"},
                        metadata={"domain": "category", "difficulty": "level", "language": "lang"})
    sample = read_samples(source)[0]
    assert sample.messages == CHAT
    assert sample.metadata.domain == "math" and sample.metadata.difficulty == 3
    assert sample.metadata.extras == {"language": "en"}
    typo = DataSource(path=str(path), columns={"messages": "dialogue"})
    with pytest.raises(DataError, match=rf"{path}:1: dialogue: missing \(columns.messages reads it\)"):
        read_samples(typo)


def test_csv_source_with_alpaca_columns(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text('instruction,input,output,level\nSum,"2, 2",4,2\n"Multi\nline",,ok,1\nbad,row,x,1,extra\n')
    source = DataSource(path=str(path), metadata={"difficulty": "level"})
    with pytest.raises(DataError, match=rf"{path}:5: more cells than the header"):
        read_samples(source)
    rows = []
    with pytest.raises(DataError):
        for sample in iter_samples(source):
            rows.append(sample)
    assert rows[0].messages[0]["content"] == "Sum\n\n2, 2" and rows[0].metadata.difficulty == 2
    assert rows[1].messages[0]["content"] == "Multi\nline" and rows[1].metadata.origin == f"{path}:3"


def test_hf_source_reads_a_local_dataset_directory_with_subsets_and_splits(tmp_path):
    root = tmp_path / "my_dataset"
    (root / "chat").mkdir(parents=True)
    (root / "pairs").mkdir()
    write_jsonl(root / "chat" / "train.jsonl", [{"conversations": [{"from": "human", "value": f"q{i}"},
                                                                   {"from": "gpt", "value": f"a{i}"}]}
                                                for i in range(3)])
    write_jsonl(root / "chat" / "test.jsonl", [{"conversations": [{"from": "human", "value": "2+2?"},
                                                                  {"from": "gpt", "value": "4"}]}])
    write_jsonl(root / "pairs" / "train.jsonl", [{"prompt": "q", "chosen": "good", "rejected": "bad",
                                                  "score_chosen": 9.0, "score_rejected": 2.5}])
    # The dataset card's `configs` (what a hub dataset's README holds) names the subsets and their splits.
    card = {"configs": [
        {"config_name": "chat", "data_files": [{"split": "train", "path": "chat/train.jsonl"},
                                               {"split": "test", "path": "chat/test.jsonl"}]},
        {"config_name": "pairs", "data_files": [{"split": "train", "path": "pairs/train.jsonl"}]},
    ]}
    (root / "README.md").write_text(f"---\n{yaml.safe_dump(card)}---\n# my dataset\n")
    chat = read_samples(DataSource(hf=str(root), subset="chat"))
    assert [s.messages[1]["content"] for s in chat] == ["a0", "a1", "a2"]
    assert chat[2].metadata.origin == f"hf:{root}/chat:train:row 2" and chat[0].metadata.source == str(root)
    assert read_samples(DataSource(hf=str(root), subset="chat", split="test"))[0].messages == CHAT
    pairs = read_preference_pairs(DataSource(hf=str(root), subset="pairs"))
    assert pairs[0].chosen == [{"role": "assistant", "content": "good"}]
    assert pairs[0].metadata.extras == {"score_chosen": 9.0, "score_rejected": 2.5}
    with pytest.raises(DataError, match=r"hf:.*/chat:nope: datasets.load_dataset failed"):
        read_samples(DataSource(hf=str(root), subset="chat", split="nope"))


def test_a_source_names_exactly_one_of_path_or_hf():
    with pytest.raises(ValueError, match="exactly one of path"):
        DataSource(path="a.jsonl", hf="org/name")
    with pytest.raises(ValueError, match="exactly one of path"):
        DataSource()


def test_saved_dataset_rows_stream(tmp_path):
    datasets.Dataset.from_list([{"dialog": CHAT}] * 3).save_to_disk(str(tmp_path / "saved"))
    samples = read_samples(DataSource(path=str(tmp_path / "saved"), columns={"messages": "dialog"}))
    assert len(samples) == 3 and samples[1].metadata.origin == f"{tmp_path / 'saved'}:row 1"


def test_non_utf8_line_and_empty_file_are_named(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({"messages": CHAT}).encode() + b"\n" + '{"x": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=rf"{path}:2: not valid UTF-8 \(byte 0xe9 at column 11\)"):
        read_samples(DataSource(path=str(path)))
    rejects = RejectLog(tmp_path / "rejects.jsonl")
    assert len(read_samples(DataSource(path=str(path)), "skip", rejects)) == 1
    rejects.close()
    assert json.loads((tmp_path / "rejects.jsonl").read_text())["line"] == 2
    for name, content in (("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("empty.csv", "instruction,output\n")):
        (tmp_path / name).write_text(content)
        with pytest.raises(DataError, match=rf"{tmp_path / name}: empty \(no records\)"):
            read_samples(DataSource(path=str(tmp_path / name)))


def test_a_byte_order_mark_as_windows_tools_write_it_is_not_part_of_the_first_record(tmp_path):
    # Notepad's UTF-8 and Excel's "CSV UTF-8" start the file with EF BB BF: it was "malformed JSON" on line 1,
    # and in a CSV it joined the first header (a column "\ufeffinstruction" that no mapping names)
    jsonl = tmp_path / "notepad.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps({"messages": CHAT}) + "\r\n" for _ in range(2)).encode())
    assert [s.messages for s in read_samples(DataSource(path=str(jsonl)))] == [CHAT, CHAT]
    csv_path = tmp_path / "excel.csv"
    csv_path.write_bytes(b"\xef\xbb\xbfinstruction,output\r\n2+2?,4\r\n")
    assert read_samples(DataSource(path=str(csv_path)))[0].messages == CHAT
    # only at the start of the file: further down it is a character of that line's text
    later = tmp_path / "later.jsonl"
    line = json.dumps({"messages": CHAT}).encode()
    later.write_bytes(line + b"\n\xef\xbb\xbf" + line)
    with pytest.raises(DataError, match=rf"{later}:2: malformed JSON"):
        read_samples(DataSource(path=str(later)))


def test_a_conversation_that_opens_with_a_reply_is_named_not_a_template_failure(tmp_path):
    # it was "the chat template failed on 0 messages: Cannot apply chat template to an empty conversation"
    path = write_jsonl(tmp_path / "greeting.jsonl", [{"messages": CHAT}, {"messages": [
        {"role": "assistant", "content": "Hello! How can I help?"}, *CHAT]}])
    with pytest.raises(DataError, match=rf"{path}:2: messages\[0\]\.role: the conversation starts with an assistant"):
        read_samples(DataSource(path=str(path)))


def test_packing_error_names_the_samples_origin():
    sample = TokenizedSample([1] * 20, [1] * 20)
    sample.metadata.origin = "train.jsonl:7"
    with pytest.raises(DataError, match="train.jsonl:7 has 20 tokens, more than max_length=10"):
        build_epoch([sample], epoch=0, seed=0, max_length=10, pack=True)


def test_implicit_prompt_pairs_share_their_prompt_turns(tmp_path):
    user = {"role": "user", "content": "Name a prime."}
    implicit = {"chosen": [user, {"role": "assistant", "content": "7"}],
                "rejected": [user, {"role": "assistant", "content": "8"}], "score_chosen": 8, "score_rejected": 3}
    multi = {"chosen": [user, {"role": "assistant", "content": "7"}, {"role": "user", "content": "another"},
                        {"role": "assistant", "content": "11"}],
             "rejected": [user, {"role": "assistant", "content": "7"}, {"role": "user", "content": "another"},
                          {"role": "assistant", "content": "12"}]}
    unrelated = {"chosen": [user, {"role": "assistant", "content": "7"}],
                 "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "8"}]}
    path = write_jsonl(tmp_path / "pairs.jsonl", [implicit, multi, unrelated])
    with pytest.raises(DataError, match=rf"{path}:3: rejected: shares no prompt turn"):
        read_preference_pairs(DataSource(path=str(path)))
    pairs = load_preference_data(PreferenceDataConfig(train=[DataSource(path=str(path))], on_invalid="skip"),
                                 rejects_dir=tmp_path).train
    assert pairs[0].prompt == [user] and pairs[0].chosen == [{"role": "assistant", "content": "7"}]
    assert pairs[0].metadata.extras == {"score_chosen": 8, "score_rejected": 3}
    assert [m["content"] for m in pairs[1].prompt] == ["Name a prime.", "7", "another"]
    assert pairs[1].rejected == [{"role": "assistant", "content": "12"}]
    assert pairs[1].origin == f"{path}:2"


def test_preference_column_mapping(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "q", "good": "a", "bad": "b", "topic": "t"}])
    source = DataSource(path=str(path), columns={"prompt": "question", "chosen": "good", "rejected": "bad"},
                        metadata={"domain": "topic"})
    pair = read_preference_pairs(source)[0]
    assert pair.prompt[0]["content"] == "q" and pair.rejected[0]["content"] == "b" and pair.metadata.domain == "t"


def test_sft_run_on_the_built_in_model_with_a_non_utf8_line_is_one_line(tmp_path):
    good = [json.dumps({"messages": CHAT})] * 40
    path = tmp_path / "train.jsonl"
    path.write_bytes("\n".join(good[:3]).encode() + b"\n" + b'{"messages": "\xff\xfe"}\n'
                     + "\n".join(good[3:]).encode() + b"\n")
    (tmp_path / "empty.jsonl").write_text("")
    recipe = {"stage": "sft", "output_dir": str(tmp_path / "run"), "model": {"preset": "tiny-1m"},
              "data": {"train": [{"path": str(path)}], "max_length": 64},
              "train": {"batch_size": 4, "max_steps": 1}, "runtime": {"precision": "fp32", "num_threads": 1},
              "tracking": {"tensorboard": False, "progress": False}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    command = [sys.executable, "-m", "posttrain.cli", "sft", str(tmp_path / "recipe.yaml")]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert f"{path}:4: not valid UTF-8 (byte 0xff" in result.stderr
    empty = subprocess.run([*command, f"data.train=[{{path: {tmp_path / 'empty.jsonl'}}}]"],
                           capture_output=True, text=True)
    assert empty.returncode == 2 and f"{tmp_path / 'empty.jsonl'}: empty (no records)" in empty.stderr, empty.stderr


def test_a_sample_the_template_refuses_is_named_by_file_and_line(tmp_path):
    from posttrain.data import tokenize_samples
    from posttrain.models import train_tokenizer

    path = write_jsonl(tmp_path / "train.jsonl", ["", {"messages": CHAT}])
    tokenizer = train_tokenizer(["2+2? 4"], vocab_size=300)
    tokenizer.chat_template = "{% for m in messages %}{% if loop.last %}{{ m['content'] }}{% endif %}{% endfor %}"
    samples = read_samples(DataSource(path=str(path)))
    with pytest.raises(DataError, match=rf"^{path}:2: .*not prefix-stable"):  # was "sample 0 (source ...)"
        tokenize_samples(samples, tokenizer, 64)
