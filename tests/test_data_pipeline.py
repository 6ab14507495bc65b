"""The one-call SFT data pipeline: counts at every step, held-out isolation, per-epoch rows that resume exactly."""

import json

import pytest

from posttrain.config import DataSource, SFTDataConfig
from posttrain.data import DataError, collate, prepare_sft_data, read_all_texts
from posttrain.models import train_tokenizer


def record(a: int, b: int, domain: str = "arithmetic") -> dict:
    return {
        "messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}],
        "metadata": {"domain": domain, "difficulty": len(str(max(a, b))), "reasoning_trace": f"{a}+{b}"},
    }


def write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([f"{a}+{b}={a + b} hello" for a in range(100) for b in range(10)])


@pytest.fixture
def sources(tmp_path):
    arithmetic = [record(a, b) for a in range(30) for b in range(10)]
    arithmetic += [record(3, 4), record(3, 4)]  # exact duplicates of one above
    arithmetic += ["{broken", {"messages": [{"role": "user", "content": "no reply"}]}]
    extraction = [record(a, 100 + a, domain="extraction") for a in range(20)]
    evals = [{"id": "leak", "prompt": "7+7="}]
    return {
        "arithmetic": write(tmp_path / "arithmetic.jsonl", arithmetic),
        "extraction": write(tmp_path / "extraction.jsonl", extraction),
        "eval": write(tmp_path / "eval.jsonl", evals),
        "dir": tmp_path,
    }


def config(sources, **overrides) -> SFTDataConfig:
    data = {
        "train": [{"path": sources["arithmetic"]}, {"path": sources["extraction"]}],
        "heldout_fraction": 0.1,
        "mix": {"by": ["domain"], "weights": {"arithmetic": 1, "extraction": 1}},
        "decontaminate": {"against": [{"path": sources["eval"]}]},
        "on_invalid": "skip",
        "max_length": 64,
    }
    data.update(overrides)
    return SFTDataConfig.model_validate(data)


def test_report_counts_every_step(sources, tokenizer):
    prepared = prepare_sft_data(config(sources), tokenizer, seed=0, rejects_dir=sources["dir"] / "run")
    report = prepared.report
    assert report["read_total"] == 302 + 20 and report["rejected"] == 2
    assert len((sources["dir"] / "run" / "rejects.jsonl").read_text().splitlines()) == 2
    assert report["exact_duplicates"] == 2
    assert report["decontaminated"] == 1 and report["decontamination"]["contaminated"][0]["eval_items"] == ["leak"]
    assert report["truncated"] == 0 and report["dropped"] == 0
    total = report["train"]["samples"] + report["heldout"]["samples"]
    assert total == 322 - 2 - 1  # read, minus duplicates, minus the contaminated one
    mixture = report["mixture"]["groups"]
    assert mixture["extraction"]["target_share"] == 0.5 and abs(mixture["extraction"]["realized_share"] - 0.5) < 0.01
    assert mixture["extraction"]["available"] < 20 + 1  # some went to held-out


def test_heldout_prompts_never_appear_in_training(sources, tokenizer):
    prepared = prepare_sft_data(config(sources), tokenizer, seed=0, rejects_dir=sources["dir"])
    train_ids = {tuple(s.input_ids) for s in prepared.train}
    assert prepared.heldout and not any(tuple(s.input_ids) in train_ids for s in prepared.heldout)
    assert sum(r.num_documents for r in prepared.heldout_rows()) == len(prepared.heldout)


def test_given_heldout_sources_remove_matching_train_prompts(sources, tokenizer):
    heldout = write(sources["dir"] / "heldout.jsonl", [record(1, 1), record(2, 5)])
    data = config(sources, heldout=[DataSource(path=heldout)], heldout_fraction=0.0)
    prepared = prepare_sft_data(data, tokenizer, seed=0, rejects_dir=sources["dir"])
    assert prepared.report["heldout_prompt_overlap_removed"] == 2 and len(prepared.heldout) == 2


def test_epoch_rows_are_redrawn_per_epoch_and_identical_on_resume(sources, tokenizer):
    data = config(sources)
    first = prepare_sft_data(data, tokenizer, seed=3, rejects_dir=sources["dir"])
    resumed = prepare_sft_data(data, tokenizer, seed=3, rejects_dir=sources["dir"])
    assert first.epoch_rows(1) == resumed.epoch_rows(1)
    assert first.epoch_rows(0) != first.epoch_rows(1)
    rows = first.epoch_rows(0)
    assert all(len(r) <= 64 for r in rows) and max(r.num_documents for r in rows) > 1
    batch = collate(rows[:4], tokenizer.pad_token_id)
    assert batch["input_ids"].shape[0] == 4


def test_strict_mode_stops_at_the_first_bad_record(sources, tokenizer):
    with pytest.raises(DataError, match=r"arithmetic\.jsonl:303: malformed JSON"):
        prepare_sft_data(config(sources, on_invalid="error"), tokenizer, seed=0)


def test_tokenizer_corpus_reads_every_text_and_passes_over_bad_records(sources):
    texts = read_all_texts(config(sources))
    assert "<think>3+4</think>7" in texts and "12+3=" in texts
    assert len(texts) == 2 * (300 + 2 + 20)  # user and reply of every valid record; the two bad ones passed over
