"""The streaming SFT pipeline: the same samples as the in-memory one, exact resume, bounded dedup, the mix."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest

from posttrain.config import SFTDataConfig
from posttrain.data import BloomFilter, DataError, prepare_sft_data
from posttrain.data.stream import StreamingSFTData
from posttrain.models import train_tokenizer


def chat(question: str, answer: str, domain: str = "general") -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            "metadata": {"domain": domain}}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([f"what is {i}+{i}? {2 * i} word{i}" for i in range(300)], vocab_size=300)


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def documents(rows) -> Counter:
    found = Counter()
    for row in rows:
        start = 0
        for doc in range(row.num_documents):
            end = start + row.document_ids.count(doc)
            found[tuple(row.input_ids[start:end])] += 1
            start = end
    return found


def config(paths, **data) -> SFTDataConfig:
    base = {"train": [{"path": str(p)} for p in paths], "max_length": 64,
            "stream": {"chunk_samples": 16, "mix_buffer": 32, "pack_window": 24}}
    return SFTDataConfig.model_validate({**base, **data})


def test_streaming_yields_the_in_memory_pipelines_samples(tmp_path, tokenizer):
    records = [chat(f"what is {i}+{i}?", str(2 * i)) for i in range(150)] + [chat("what is 1+1?", "2")] * 3
    path = write(tmp_path / "train.jsonl", records)
    memory = prepare_sft_data(config([path]), tokenizer, seed=0)
    stream = prepare_sft_data(config([path], streaming=True), tokenizer, seed=0)
    assert isinstance(stream, StreamingSFTData)
    rows = stream.epoch_rows(0)
    assert stream.report["read_to_end"] is False and rows.known_length is None  # nothing counted before training
    streamed = rows[0:None]
    assert documents(streamed) == documents(memory.epoch_rows(0))
    assert stream.report["read_to_end"] is True and rows.known_length == len(streamed)
    assert stream.report["dedup"]["exact_duplicates"] == memory.report["exact_duplicates"] == 3
    assert stream.report["read"] == {str(path): 153} and stream.report["samples"] == 150
    assert all(len(row) <= 64 for row in rows[0:None])


def test_streaming_epochs_are_deterministic_and_resume_by_slices(tmp_path, tokenizer):
    path = write(tmp_path / "train.jsonl", [chat(f"what is {i}+{i}?", str(2 * i)) for i in range(200)])
    data = prepare_sft_data(config([path], streaming=True), tokenizer, seed=3)
    every = list(data.iter_rows(1))
    rows = data.epoch_rows(1)
    assert not hasattr(rows, "__len__") and rows.count() == len(every) == rows.known_length
    assert rows[0:4] + rows[4:9] == every[:9]
    assert rows[2:5] == every[2:5]  # an earlier slice re-streams from the start
    resumed = data.epoch_rows(1)
    assert resumed[7:12] == every[7:12]  # a resume at row 7
    assert [r.input_ids for r in every] != [r.input_ids for r in data.iter_rows(2)]  # another epoch, another order


def test_streaming_heldout_fraction_collects_the_split_off_samples(tmp_path, tokenizer):
    path = write(tmp_path / "train.jsonl", [chat(f"what is {i}+{i}?", str(2 * i)) for i in range(300)])
    memory = prepare_sft_data(config([path], heldout_fraction=0.2), tokenizer, seed=0)
    stream = prepare_sft_data(config([path], heldout_fraction=0.2, streaming=True), tokenizer, seed=0)
    assert len(stream.heldout) == len(memory.heldout) > 30
    stream.epoch_rows(0).count()
    assert stream.report["heldout_split"] == len(memory.heldout)
    assert documents(stream.heldout_rows()) == documents(memory.heldout_rows())


def test_bloom_filter_false_positives_stay_near_the_rate_it_was_sized_for():
    bloom = BloomFilter(capacity=20_000, error_rate=1e-3)
    assert sum(not bloom.add(f"item {i}".encode()) for i in range(20_000)) <= 20  # fills up to the rate
    assert not bloom.add(b"item 7")
    false_positives = sum(f"other {i}".encode() in bloom for i in range(20_000))
    assert false_positives <= 3 * 20  # expected ~20 at 1e-3
    assert bloom.nbytes < 40_000  # ~14.4 bits per item
    assert 0.5e-3 < bloom.false_positive_rate < 2e-3  # the rate at this fill: the capacity's
    for i in range(20_000, 60_000):  # past the capacity (3x) the rate it reports rises, and so do the drops
        bloom.add(f"item {i}".encode())
    assert bloom.false_positive_rate > 0.1
    assert sum(f"more {i}".encode() in bloom for i in range(2000)) > 0.5 * 0.1 * 2000


def test_streaming_near_dedup_drops_a_near_copy(tmp_path, tokenizer):
    text = "the quick brown fox jumps over the lazy dog near the river bank today"
    records = [chat(text, "yes"), chat(text.replace("today", "today!"), "yes"), chat("something else entirely", "no")]
    path = write(tmp_path / "train.jsonl", records)
    data = prepare_sft_data(config([path], streaming=True, max_length=256, dedup={"near": True, "threshold": 0.8}),
                            tokenizer, seed=0)
    data.epoch_rows(0).count()  # the report counts what a pass has read
    assert data.report["dedup"]["near_duplicates"] == 1 and data.report["samples"] == 2


def test_streaming_mix_follows_the_weights_while_every_group_is_buffered(tmp_path, tokenizer):
    records = [chat(f"{domain} q{i}", f"{domain}{i}", domain) for i in range(600) for domain in ("a", "b", "c")]
    path = write(tmp_path / "train.jsonl", records)
    mix = {"by": ["domain"], "weights": {"a": 3, "b": 1, "c": 0}}
    data = prepare_sft_data(config([path], streaming=True, pack=False, mix=mix, stream={"mix_buffer": 200}),
                            tokenizer, seed=0)
    assert data.report["mix_rates"] == {"a": 1.5, "b": 0.5, "c": 0.0}
    rows = data.epoch_rows(0)[0:None]
    assert data.report["mixed_out"] == 600
    answers = Counter(_answer(tokenizer, row)[0] for row in rows)
    assert abs(len(rows) - 1200) < 60 and set(answers) == {"a", "b"}
    assert 0.71 < answers["a"] / len(rows) < 0.79  # the in-memory mix's 75%, in expectation
    with pytest.raises(DataError, match="no samples in group 'd'"):
        prepare_sft_data(config([path], streaming=True, mix={"by": ["domain"], "weights": {"d": 1}}), tokenizer,
                         seed=0)


def _answer(tokenizer, row) -> str:
    return tokenizer.decode([t for t, m in zip(row.input_ids, row.loss_mask) if m], skip_special_tokens=True)


def test_streaming_decontaminates_against_the_eval_set(tmp_path, tokenizer):
    path = write(tmp_path / "train.jsonl", [chat(f"what is {i}+{i}?", str(2 * i)) for i in range(50)])
    evals = write(tmp_path / "eval.jsonl", [chat("what is 7+7?", "14")])
    data = prepare_sft_data(config([path], streaming=True, decontaminate={"against": [{"path": str(evals)}]}),
                            tokenizer, seed=0)
    data.epoch_rows(0).count()
    assert data.report["decontaminated"] == 1 and data.report["samples"] == 49


def test_training_streams_each_epoch_once_and_ends_it_without_counting(tmp_path, tokenizer, monkeypatch):
    """The loop finds an epoch's end by reading past it: each epoch is one pass over the file, none before."""
    from posttrain.data import stream as stream_module
    from posttrain.train import Cursor, StepFigures, train_loop

    passes = []
    real = stream_module.iter_samples
    monkeypatch.setattr(stream_module, "iter_samples", lambda *a, **k: (passes.append(1), real(*a, **k))[1])
    path = write(tmp_path / "train.jsonl", [chat(f"what is {i}+{i}?", str(2 * i)) for i in range(120)])
    data = prepare_sft_data(config([path], streaming=True, pack=False), tokenizer, seed=0)
    assert passes == []  # preparing reads nothing: no counting pass
    seen: list[tuple[int, int]] = []

    def step(rows):
        seen.append((cursor.epoch, len(rows)))
        return StepFigures(loss=0.0, grad_norm=0.0, weight=1, tokens=sum(len(r) for r in rows))

    class Train:
        batch_size, max_minutes, log_every, eval_every, save_every = 50, None, 1, 0, 0

    class Tracker:
        logged = []
        def log(self, metrics, step): self.logged.append(metrics)
        def start_progress(self, total, done=0): pass
        def advance(self, step, text): pass

    class Scheduler:
        def get_last_lr(self): return [0.1]

    cursor, tracker = Cursor(), Tracker()
    train_loop("sft", Train(), cursor, 7, epoch_items=data.epoch_rows, step=step, scheduler=Scheduler(),
               tracker=tracker, save=lambda: None)
    # 120 rows in steps of 50: a short last step ends each epoch; three epochs started, three passes
    assert seen == [(0, 50), (0, 50), (0, 20), (1, 50), (1, 50), (1, 20), (2, 50)]
    assert len(passes) == 3 and (cursor.epoch, cursor.row) == (2, 50)
    assert [m["train/epoch"] for m in tracker.logged][:3] == [0.0, 0.0, 1.0]  # known once read to its end
    assert data.report["read_to_end"] and data.report["samples"] == 120
    with pytest.raises(DataError, match="no training sample left"):
        empty = write(tmp_path / "empty.jsonl", [chat("what is 1+1?", "2")])
        prepare_sft_data(config([empty], streaming=True, heldout_fraction=0.99), tokenizer, seed=0).epoch_rows(0)[0:1]


def test_list_of_parts_content_streams_as_its_joined_text(tmp_path, tokenizer):
    """OpenAI list-of-parts contents (text parts joined with a newline) give the rows the same chats written
    as strings give, streamed (twice: a re-streamed epoch) and in memory."""
    def parts(record):
        record = json.loads(json.dumps(record))
        for message in record["messages"]:
            text = message["content"]
            message["content"] = [{"type": "text", "text": piece} for piece in text.split("\n")]
        return record

    plain = [chat(f"what is {i}+{i}?\nword{i}", str(2 * i)) for i in range(60)]
    as_parts = write(tmp_path / "parts.jsonl", [parts(r) for r in plain])
    as_text = write(tmp_path / "text.jsonl", plain)
    expected = list(prepare_sft_data(config([as_text], streaming=True), tokenizer, seed=0).iter_rows(0))
    streamed = prepare_sft_data(config([as_parts], streaming=True), tokenizer, seed=0)
    assert list(streamed.iter_rows(0)) == expected and list(streamed.iter_rows(0)) == expected
    memory = prepare_sft_data(config([as_parts]), tokenizer, seed=0)
    assert documents(memory.epoch_rows(0)) == documents(expected)


def _mixed_run(tmp_path, tokenizer, monkeypatch):
    """A mixed run with every per-file step on: duplicates, a bad line skipped, held-out split, decontamination."""
    from posttrain.data import stream as stream_module

    reads = []
    real = stream_module.iter_samples
    monkeypatch.setattr(stream_module, "iter_samples", lambda *a, **k: (reads.append(1), real(*a, **k))[1])
    records = [chat(f"what is {i}+{i}? {d}", f"{d}{2 * i}", d) for i in range(120) for d in ("a", "b", "c")]
    path = write(tmp_path / "train.jsonl", records + records[:30])
    with open(path, "a") as handle:
        handle.write("not json\n")
    evals = write(tmp_path / "eval.jsonl", [chat("what is 7+7? a", "a14")])
    mix = {"by": ["domain"], "weights": {"a": 3, "b": 1, "c": 0}, "samples_per_epoch": 300}
    data = prepare_sft_data(config([path], streaming=True, heldout_fraction=0.1, on_invalid="skip", mix=mix,
                                   decontaminate={"against": [{"path": str(evals)}]}),
                            tokenizer, seed=5, rejects_dir=tmp_path)
    return data, reads


def test_a_mixed_run_reads_each_file_once_and_packs_the_rows_the_two_pass_pipeline_did(tmp_path, tokenizer,
                                                                                        monkeypatch):
    """The reading pass that counts the mix groups also tokenizes into the spill the epochs are mixed from: the
    file is read once for preparing and two epochs (before: a survey pass, one per epoch, one for the held-out
    split), with the two-pass pipeline's counts, held-out samples and rejects. The rows of epochs 0 and 1 are
    pinned by their digest: the two-pass pipeline's until the mixer drew its random numbers a chunk at a time
    (one batch per chunk instead of one draw per sample: other draws, so other copies and order; 296 samples
    against 300 then, the same 300 in expectation)."""
    data, reads = _mixed_run(tmp_path, tokenizer, monkeypatch)
    rows = [[r.input_ids, r.loss_mask, r.position_ids, r.document_ids] for e in (0, 1) for r in data.iter_rows(e)]
    assert reads == [1]
    assert len(rows) == 196 and hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16] == "640f11bcb07298ee"
    report = data.report
    assert (report["heldout_split"], report["decontaminated"], report["mixed_out"], report["samples"],
            report["rows"]) == (33, 1, 111, 296, 99)
    assert report["dedup"]["exact_duplicates"] == 30 and report["dedup"]["rejected"] == 1
    assert report["mix_rates"] == {"a": 2.142857, "b": 0.681818, "c": 0.0} and len(data.heldout) == 33
    assert len((tmp_path / "rejects.jsonl").read_text().splitlines()) == 1  # written once, not once per epoch
    assert report["spill"]["samples"] == 360 - 33 - 1 and report["spill"]["bytes"] > 0


def test_the_spill_gives_the_rows_streaming_from_the_file_gives(tmp_path, tokenizer):
    """Weights that keep every sample once (rate 1 per group) mix from the spill exactly as an unmixed run mixes
    straight from the file (the same random draws): the spill holds the same samples in the same order."""
    path = write(tmp_path / "train.jsonl", [chat(f"{d} q{i}", f"{d}{i}", d) for i in range(200) for d in "ab"])
    plain = prepare_sft_data(config([path], streaming=True), tokenizer, seed=2)
    spilled = prepare_sft_data(config([path], streaming=True, mix={"by": ["domain"], "weights": {"a": 1, "b": 1}}),
                               tokenizer, seed=2)
    assert spilled.spill is not None and plain.spill is None and spilled.rates == {"a": 1.0, "b": 1.0}
    for epoch in (0, 3):
        assert list(spilled.iter_rows(epoch)) == list(plain.iter_rows(epoch))
    expected = list(plain.iter_rows(0))
    rows = spilled.epoch_rows(0)
    first = rows[0:3]
    assert list(spilled.iter_rows(0)) == expected  # a second reader of the spill while the first is mid-way
    assert first + rows[3:5] == expected[:5]


def test_bloom_filter_add_many_decides_as_add_one_at_a_time():
    """The batch lookup sets the bits `add` sets and drops what `add` drops: duplicates within a batch (the
    first kept) and across batches; only its rare in-batch false positives could differ, none at this fill."""
    keys = [f"key {i % 700}".encode() for i in range(1000)]  # 300 repeats, some within one batch
    one_by_one, batched = BloomFilter(capacity=5000, error_rate=1e-4), BloomFilter(capacity=5000, error_rate=1e-4)
    expected = [one_by_one.add(key) for key in keys]
    got = [new for start in range(0, len(keys), 128) for new in batched.add_many(keys[start:start + 128])]
    assert got == expected and expected.count(True) == 700 == batched.count
    assert batched.bits == one_by_one.bits and b"key 5" in batched and b"key 701" not in batched
    assert batched.add_many([]) == []


@pytest.mark.slow
def test_streaming_memory_does_not_grow_with_the_rows(tmp_path, tokenizer):
    """Python memory at its peak (tracemalloc) over one mixed streaming pass is the same for 4x the rows: no
    per-row state (dedup is a filter of fixed size; the spill is on disk) and no garbage that waits for the
    cyclic collector (a renderer per chunk that referred to itself made the peak 1.3x at 4x the rows). The
    in-memory pipeline, as a check that the measure sees growth, peaks well above its 1x."""
    import tracemalloc

    def peak(rows: int, streaming: bool) -> int:
        path = write(tmp_path / f"train-{rows}.jsonl",
                     [chat(f"what is {i}+{i}?", str(2 * i), "ab"[i % 2]) for i in range(rows)])
        data = {"streaming": streaming, "mix": {"by": ["domain"], "weights": {"a": 2, "b": 1}},
                "stream": {"chunk_samples": 16, "mix_buffer": 32, "pack_window": 24, "dedup_capacity": 50_000}}
        tracemalloc.start()
        try:
            prepared = prepare_sft_data(config([path], **data), tokenizer, seed=0)
            for _ in (prepared.iter_rows(0) if streaming else prepared.epoch_rows(0)):
                pass
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    peak(1000, True)  # one-time allocations (the template compiled, caches filled) out of the figures
    small, large = peak(1000, True), peak(4000, True)
    assert large < 1.1 * small, (small, large)
    assert peak(4000, False) > 2.5 * peak(1000, False)
