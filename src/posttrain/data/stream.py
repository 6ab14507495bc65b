"""Streaming SFT data: a dataset far larger than memory trains with bounded memory.

    data: {streaming: true, train: [{path: huge.jsonl}], ...}      # prepare_sft_data returns StreamingSFTData

Rows flow through the same steps as the in-memory pipeline (`posttrain.data.pipeline`), a chunk at a time:

    read (line by line / record batch) -> exact and near dedup -> held-out split by prompt hash
      -> decontaminate -> tokenize (chunks of `stream.chunk_samples`) -> mix -> pack (windows of
      `stream.pack_window` samples) -> rows

What stays in memory, and why it is bounded (docs/data.md has the figures):

* exact dedup: a Bloom filter of `stream.dedup_capacity` items at false-positive rate `stream.dedup_error`
  (bits = -n ln p / ln²2, allocated once: 24 MB for 10M items at 1e-4). A false positive drops a unique
  sample with probability <= p; past the capacity the rate rises (the report has the fill, the capacity and the
  rate at that fill). A chunk is looked up at once, so a false positive comes only from earlier chunks' samples.
* near dedup: the LSH band keys of each kept sample's MinHash go into a second Bloom filter of the same
  size; a sample whose band key is already there is a near-duplicate. Unlike the in-memory pass, the
  candidate is not confirmed by its Jaccard estimate (that would keep every signature), so pairs a little
  below `threshold` are flagged too.
* decontamination: the eval sets' n-gram index, whose size is that of the eval sets, not of the training data.
* held-out: `heldout_fraction` by the stable prompt hash (no state); given held-out sources are read into
  memory (they are small) and their prompts kept in a set.
* mixing: the in-memory `mix`'s counts per group (weights over `mix.by` groups, `samples_per_epoch`),
  reached by rates. A mixed run reads its files once (`StreamingSFTData._read_into_spill`): read, dedup,
  held-out split, decontamination and tokenization, counting the samples available per group, into a
  `TokenSpill` (a temporary file: ids, masks and mix groups; disk, not memory). In every epoch each sample of
  group g, read back from the spill, is used rate_g = count_g / available_g times in expectation (floor(rate)
  copies, one more with probability rate - floor(rate), drawn a chunk at a time; weight 0 drops the group).
  The counts are exact in expectation rather than exactly; the order is the sources' order shuffled within a
  buffer of `stream.mix_buffer` samples (shuffle a sorted file beforehand). With no `mix.by`, weights or
  `samples_per_epoch` every sample is used once, there is no spill and each epoch streams from the files.
* packing: best-fit decreasing within windows of `stream.pack_window` samples, rows shuffled per window.

Everything depends only on (seed, epoch), so an epoch re-streams identically: the trainer's cursor
(epoch, row) resumes exactly by skipping rows. An epoch is never counted to be trained: the trainer reads it by
forward slices and its end is the slice that comes back empty (`RowStream.known_length` is set then). Only a
caller that needs the number before training (`train.epochs` with no `train.max_steps`, to size the LR
schedule; `posttrain validate`) asks for it, with `RowStream.count()`: one streaming pass, cached.
The held-out samples `heldout_fraction` splits off are collected by the spill's pass, or, unmixed, by reading (not
tokenizing) only until `stream.heldout_max` of them are found; the report's counts are the training pass's, as far as it has read.
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import tempfile
from array import array
from dataclasses import dataclass, field, fields
from typing import Any, Iterator

import numpy as np
from datasketch import MinHash, MinHashLSH

from posttrain.config import SFTDataConfig
from posttrain.data.decontaminate import Decontaminator, read_eval_items
from posttrain.data.dedup import _MINHASH_SEED, _shingles, conversation_text
from posttrain.data.mixing import _apportion, _weights, group_name
from posttrain.data.packing import Row, _best_fit_decreasing, _make_row, build_epoch
from posttrain.data.readers import RejectLog, iter_samples
from posttrain.data.schema import DataError, SampleMetadata, SFTSample
from posttrain.data.split import prompt_fraction
from posttrain.data.tokenize import TokenizedSample, tokenize_samples

Chunk = tuple[list[TokenizedSample], list[str] | None]  # tokenized samples and their mix groups (None: not needed)


class BloomFilter:
    """A fixed-size Bloom filter: `add` says whether the key may have been seen before (then it is not added)."""

    def __init__(self, capacity: int, error_rate: float):
        if capacity <= 0 or not 0 < error_rate < 1:
            raise DataError(f"a Bloom filter needs capacity > 0 and 0 < error_rate < 1, got {capacity}, {error_rate}")
        self.capacity = capacity
        self.num_bits = max(64, math.ceil(-capacity * math.log(error_rate) / math.log(2) ** 2))
        self.num_hashes = max(1, round(self.num_bits / capacity * math.log(2)))
        self.bits = bytearray((self.num_bits + 7) // 8)  # a bytearray: scalar access is ~5x numpy's
        self.count = 0

    @property
    def nbytes(self) -> int:
        return len(self.bits)

    @property
    def false_positive_rate(self) -> float:
        """The chance that a new key is taken for a seen one at the present fill: (1 - e^(-k n / m))^k, at most
        the `error_rate` asked for up to `capacity` keys, above it past them."""
        return (1 - math.exp(-self.num_hashes * self.count / self.num_bits)) ** self.num_hashes

    def _positions(self, key: bytes) -> list[int]:
        digest = hashlib.blake2b(key, digest_size=16).digest()
        first, second = int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little") | 1
        return [(first + i * second) % self.num_bits for i in range(self.num_hashes)]  # double hashing

    def __contains__(self, key: bytes) -> bool:
        return all(self.bits[p >> 3] & (1 << (p & 7)) for p in self._positions(key))

    def add(self, key: bytes) -> bool:
        """True if `key` was new (and is now in the filter), False if it (probably) was already there."""
        positions = self._positions(key)
        seen = all(self.bits[p >> 3] & (1 << (p & 7)) for p in positions)
        if not seen:
            for p in positions:
                self.bits[p >> 3] |= 1 << (p & 7)
            self.count += 1
        return not seen

    def add_many(self, keys: list[bytes]) -> list[bool]:
        """`add` for a batch, vectorized: each key's new-ness, the first of equal keys counting as new. The
        batch is looked up in the filter as it was before the batch (the same positions as `add`), so a false
        positive can only come from an earlier batch's keys: a key whose bits happen to be set by other keys of
        its own batch is kept, where `add` one at a time would (rarely) drop it."""
        if not keys:
            return []
        digests = np.frombuffer(b"".join(hashlib.blake2b(key, digest_size=16).digest() for key in keys),
                                dtype="<u8").reshape(len(keys), 2)
        # (first + i * second) mod m as in `_positions`, from first and second reduced mod m: no uint64 overflow.
        first, second = digests[:, 0] % self.num_bits, (digests[:, 1] | 1) % self.num_bits
        positions = (first[:, None] + np.arange(self.num_hashes, dtype=np.uint64)[None, :] * second[:, None]) \
            % self.num_bits
        byte_index, bit = positions >> 3, (np.uint8(1) << (positions & 7).astype(np.uint8))
        bits = np.frombuffer(self.bits, dtype=np.uint8)  # a view: writes go to the bytearray
        new = ~((bits[byte_index] & bit) != 0).all(axis=1)
        first_of_batch: dict[bytes, int] = {}
        for index in np.flatnonzero(new).tolist():  # equal keys within the batch: the first one is new
            if first_of_batch.setdefault(keys[index], index) != index:
                new[index] = False
        np.bitwise_or.at(bits, byte_index[new].ravel(), bit[new].ravel())
        self.count += int(new.sum())
        return new.tolist()


class StreamDedup:
    """Exact and near-duplicate removal over a stream, in the bounded state described in the module docstring."""

    def __init__(self, config: SFTDataConfig):
        stream, dedup = config.stream, config.dedup
        self.exact = BloomFilter(stream.dedup_capacity, stream.dedup_error) if dedup.exact else None
        self.near = BloomFilter(stream.dedup_capacity, stream.dedup_error) if dedup.near else None
        if dedup.near:
            lsh = MinHashLSH(threshold=dedup.threshold, num_perm=dedup.num_perm)  # datasketch's banding choice
            self.bands, self.rows_per_band = lsh.b, lsh.r
            # The hash permutations, drawn once: MinHash(seed=...) would draw 2 x num_perm numbers per sample.
            template = MinHash(num_perm=dedup.num_perm, seed=_MINHASH_SEED)
            self._permutations, self._scheme = template.permutations, template.scheme
        self.config = dedup
        self.exact_duplicates = self.near_duplicates = 0

    def keep(self, samples: list[SFTSample]) -> list[bool]:
        """Which of `samples` (in order, after every sample before them) are kept: exact duplicates by the
        filter's batch lookup (`BloomFilter.add_many`), then near duplicates one sample at a time."""
        if self.exact is None and self.near is None:
            return [True] * len(samples)
        texts = [conversation_text(sample.messages) for sample in samples]  # normalized: the exact key as it is
        kept = [True] * len(samples)
        if self.exact is not None:
            kept = self.exact.add_many([text.encode() for text in texts])
            self.exact_duplicates += kept.count(False)
        if self.near is not None:
            for index, text in enumerate(texts):
                if kept[index] and not self._near_new(text):
                    kept[index] = False
                    self.near_duplicates += 1
        return kept

    def _near_new(self, text: str) -> bool:
        signature = MinHash(num_perm=self.config.num_perm, seed=_MINHASH_SEED,
                            permutations=self._permutations, scheme=self._scheme)
        signature.update_batch(_shingles(text, self.config.shingle))
        values = signature.hashvalues
        keys = [b"%d:" % band + values[band * self.rows_per_band:(band + 1) * self.rows_per_band].tobytes()
                for band in range(self.bands)]
        new = [self.near.add(key) for key in keys]  # every band added, so later near copies match any band
        return all(new)

    def report(self) -> dict[str, Any]:
        state = {"exact_duplicates": self.exact_duplicates, "near_duplicates": self.near_duplicates}
        for name, bloom in (("exact", self.exact), ("near", self.near)):
            if bloom is not None:
                state[f"{name}_filter_bytes"], state[f"{name}_filter_items"] = bloom.nbytes, bloom.count
                state[f"{name}_filter_capacity"] = bloom.capacity
                state[f"{name}_filter_false_positive_rate"] = float(f"{bloom.false_positive_rate:.3g}")
        return state


@dataclass
class StreamStats:
    """Counts of one streaming epoch (complete once the epoch has been read to its end)."""

    read: dict[str, int] = field(default_factory=dict)
    heldout_split: int = 0
    heldout_prompt_overlap_removed: int = 0
    decontaminated: int = 0
    truncated: int = 0
    dropped: int = 0
    mixed_out: int = 0  # in groups of weight 0
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    rows: int = 0
    dedup: dict[str, Any] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        return dict(self.__dict__)


class TokenSpill:
    """The tokenized samples of one reading pass, on disk: a chunk at a time in, the same samples in the same
    order out, as often as asked, a chunk at a time. Per chunk: the lengths, the ids (int32) and masks (uint8)
    concatenated, and the samples' mix groups. That is all an epoch uses (rows carry no metadata), so the
    samples read back have empty metadata, and the file holds about 5 bytes per token (no origin strings).
    The file is an anonymous temporary file (`tempfile.TemporaryFile`, in `TMPDIR`): it has no name once
    created, so it is gone when the spill is, even if the process is killed. Each iterator keeps its own
    offset into the one handle, so epochs can be read side by side."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="posttrain-stream-")
        self.samples = self.nbytes = 0

    def write(self, samples: list[TokenizedSample], groups: list[str] | None = None) -> None:
        if not samples:
            return
        lengths, ids, mask = array("q", [len(s) for s in samples]), array("i"), array("B")
        for sample in samples:  # array.extend from a list runs in C
            ids.extend(sample.input_ids)
            mask.extend(sample.loss_mask)
        pickle.dump((lengths.tobytes(), ids.tobytes(), mask.tobytes(), groups), self._file,
                    protocol=pickle.HIGHEST_PROTOCOL)
        self.samples += len(samples)

    def close(self) -> None:
        """Writing is done: the spill is read from now on."""
        self._file.flush()
        self.nbytes = self._file.tell()

    def chunks(self) -> Iterator[Chunk]:
        """The chunks as written: (samples, their mix groups or None)."""
        offset = 0
        while offset < self.nbytes:
            self._file.seek(offset)
            lengths, ids, mask, groups = pickle.load(self._file)
            offset = self._file.tell()
            ids_list, mask_list = array("i", ids).tolist(), array("B", mask).tolist()
            samples, start = [], 0
            for length in array("q", lengths).tolist():
                end = start + length
                samples.append(TokenizedSample(ids_list[start:end], mask_list[start:end], _SPILLED))
                start = end
            yield samples, groups

    def __iter__(self) -> Iterator[TokenizedSample]:
        for samples, _groups in self.chunks():
            yield from samples


_SPILLED = SampleMetadata()  # the metadata of every sample read back from a spill (shared: never written to)


def stream_samples(config: SFTDataConfig, stats: StreamStats, rejects: RejectLog | None,
                   heldout_prompts: set[str], heldout_sink: list[SFTSample] | None = None) -> Iterator[SFTSample]:
    """Train samples of every source in turn: read, deduplicated, held-out split off (the first
    `stream.heldout_max` of those split off are collected in `heldout_sink`)."""
    dedup = StreamDedup(config)
    for source in config.train:
        count = 0
        for chunk in _chunks(iter_samples(source, config.on_invalid, rejects), config.stream.chunk_samples):
            count += len(chunk)
            yield from _split_off(chunk, dedup.keep(chunk), config, stats, heldout_prompts, heldout_sink)
        stats.read[source.name] = count
    stats.dedup = dedup.report()


def _chunks(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _split_off(chunk: list[SFTSample], kept: list[bool], config: SFTDataConfig, stats: StreamStats,
               heldout_prompts: set[str], heldout_sink: list[SFTSample] | None) -> Iterator[SFTSample]:
    """The deduplicated samples of `chunk` that are not held out."""
    for sample, keep in zip(chunk, kept):
        if not keep:
            continue
        if heldout_prompts:
            if sample.prompt_text in heldout_prompts:
                stats.heldout_prompt_overlap_removed += 1
                continue
        elif config.heldout_fraction > 0 and prompt_fraction(sample.prompt_text) < config.heldout_fraction:
            stats.heldout_split += 1
            if heldout_sink is not None and len(heldout_sink) < config.stream.heldout_max:
                heldout_sink.append(sample)
            continue
        yield sample


def stream_tokenized(config: SFTDataConfig, tokenizer: Any, samples: Iterator[SFTSample], stats: StreamStats,
                     decontaminator: Decontaminator | None,
                     available: dict[str, int] | None = None) -> Iterator[Chunk]:
    """Decontaminated and tokenized a chunk at a time (one batched tokenizer call per chunk). With `available`,
    each chunk comes with its samples' mix groups, and `available` counts the samples of each group that
    decontamination keeps (what the mix rates are made of); without, the groups are None."""
    for chunk in _chunks(samples, config.stream.chunk_samples):
        if decontaminator is not None:
            kept = decontaminator.check(chunk).samples
            stats.decontaminated += len(chunk) - len(kept)
            chunk = kept
        groups = None
        if available is not None:
            groups = [group_name(sample.metadata, config.mix.by) for sample in chunk]
            for name in groups:
                available[name] = available.get(name, 0) + 1
        tokenized = tokenize_samples(chunk, tokenizer, config.max_length, config.reasoning)
        stats.truncated += tokenized.truncated
        stats.dropped += tokenized.dropped
        yield tokenized.samples, None if groups is None else [groups[i] for i in tokenized.sources]


def stream_mixed(config: SFTDataConfig, chunks: Iterator[Chunk], rng: np.random.Generator, stats: StreamStats,
                 rates: dict[str, float] | None) -> Iterator[list[TokenizedSample]]:
    """Each sample of group g kept ``rate_g`` times in expectation (floor(rate) copies, one more with
    probability rate - floor(rate)), through a shuffle buffer of `stream.mix_buffer` samples: once the buffer
    is full, each sample put in takes a random one out. Yields what comes out, a list per chunk read."""
    buffer: list[TokenizedSample] = []
    capacity = config.stream.mix_buffer
    for samples, groups in chunks:
        if rates is None:
            copies = [1] * len(samples)
        else:
            rate = np.array([rates.get(name, 0.0) for name in groups])  # type: ignore[union-attr]
            whole = np.floor(rate)
            if (rate > whole).any():  # whole rates draw nothing: every sample once mixes as an unmixed run does
                whole += rng.random(len(samples)) < rate - whole
            copies = whole.astype(int).tolist()
            stats.mixed_out += int((rate == 0).sum())
        draws = iter(rng.random(sum(copies)).tolist())  # one per sample put in: where the one taken out is
        out = []
        for sample, count in zip(samples, copies):
            for _ in range(count):
                buffer.append(sample)
                if len(buffer) >= capacity:
                    index = int(next(draws) * len(buffer))
                    buffer[index], buffer[-1] = buffer[-1], buffer[index]
                    out.append(buffer.pop())
        yield out
    yield [buffer[int(i)] for i in rng.permutation(len(buffer))]


def mix_rates(config: SFTDataConfig, available: dict[str, int]) -> dict[str, float]:
    """Per group, how many times each of its samples is used in an epoch: the in-memory `mix`'s counts
    (`samples_per_epoch` or every kept sample, shared by weight) over the samples available."""
    weights = _weights({name: [] for name in available}, config.mix)
    kept = {name: w for name, w in weights.items() if w > 0}
    if not kept:
        raise DataError("data.mix: every group has weight 0; nothing to train on")
    total = config.mix.samples_per_epoch or sum(available[name] for name in kept)
    counts = _apportion(kept, total)
    return {name: counts.get(name, 0) / available[name] for name in available}


def stream_packed(config: SFTDataConfig, batches: Iterator[list[TokenizedSample]], rng: np.random.Generator,
                  stats: StreamStats) -> Iterator[Row]:
    """Rows packed by best-fit decreasing within windows of `stream.pack_window` samples."""
    size = config.stream.pack_window

    def flush(window: list[TokenizedSample]) -> Iterator[Row]:
        stats.samples += len(window)
        stats.tokens += sum(len(s) for s in window)
        stats.loss_tokens += sum(s.num_loss_tokens for s in window)
        if config.pack:
            bins = _best_fit_decreasing([len(s) for s in window], config.max_length)
        else:
            bins = [[i] for i in range(len(window))]
        rows = [_make_row([window[i] for i in members]) for members in bins]
        for i in rng.permutation(len(rows)):
            stats.rows += 1
            yield rows[int(i)]

    window: list[TokenizedSample] = []
    for batch in batches:
        window.extend(batch)
        while len(window) >= size:
            yield from flush(window[:size])
            window = window[size:]
    if window:
        yield from flush(window)


class RowStream:
    """The rows of one streaming epoch as the trainer reads them: forward slices ``rows[a:b]`` (a slice before
    the current position re-streams the epoch from its start). It has no `len`: the epoch ends where a slice
    comes back short or empty, and `known_length` is the number of rows from then on (None before);
    `count()` counts them with a pass of its own."""

    def __init__(self, data: StreamingSFTData, epoch: int):
        self.data, self.epoch = data, epoch
        self._iterator: Iterator[Row] | None = None
        self._position = 0

    @property
    def known_length(self) -> int | None:
        return self.data.known_rows(self.epoch)

    def count(self) -> int:
        """The epoch's rows, by one streaming pass (cached; none if the epoch was already read to its end)."""
        return self.data.count_rows(self.epoch)

    def __getitem__(self, index: slice) -> list[Row]:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a streaming epoch is read by forward slices rows[a:b]")
        start, stop = index.start or 0, index.stop
        if self._iterator is None or start < self._position:
            self._iterator, self._position = self.data.iter_rows(self.epoch), 0
        while self._position < start and next(self._iterator, None) is not None:
            self._position += 1
        rows = []
        while stop is None or self._position < stop:
            row = next(self._iterator, None)
            if row is None:
                break
            rows.append(row)
            self._position += 1
        return rows


class StreamingSFTData:
    """`PreparedSFTData`'s interface over a stream: `epoch_rows`, `heldout_rows`, `has_heldout`, `report`."""

    def __init__(self, config: SFTDataConfig, tokenizer: Any, seed: int, rejects_path: Any = None,
                 heldout: list[TokenizedSample] | None = None, heldout_prompts: set[str] | None = None):
        self.config, self.tokenizer, self.seed = config, tokenizer, seed
        self.rejects_path = rejects_path
        self.heldout = heldout or []
        self.heldout_prompts = heldout_prompts or set()
        self.decontaminator = None
        if config.decontaminate.against:
            items = [item for source in config.decontaminate.against for item in read_eval_items(source)]
            self.decontaminator = Decontaminator(items, tokenizer, config.decontaminate.ngram)
        self._report: dict[str, Any] = {"streaming": True, "read_to_end": False}
        self._live: tuple[StreamStats, int] | None = None  # the pass the report follows until one completes
        self._counts: dict[int, int] = {}
        self._rejects_written = 0  # every pass meets the same rejects in the same order: written once
        self.rates: dict[str, float] | None = None
        self.spill: TokenSpill | None = None  # a mixed run's tokenized samples, read once (`_read_into_spill`)
        self._spill_stats = StreamStats()
        self._split_off: list[SFTSample] | None = None
        if config.mix.by or config.mix.samples_per_epoch or config.mix.weights:
            self.rates = mix_rates(config, self._read_into_spill())
            self._report["mix_rates"] = {name: round(rate, 6) for name, rate in self.rates.items()}
            self._report["spill"] = {"samples": self.spill.samples, "bytes": self.spill.nbytes}

    @property
    def report(self) -> dict[str, Any]:
        """What the data report knows: the first completed pass's counts (``read_to_end: True``), or those of
        the latest pass so far, as far as it has read."""
        report = dict(self._report)
        if self._live is not None:
            stats, epoch = self._live
            report.update(stats.report(), epoch=epoch, read_to_end=False)
        return report

    @property
    def has_heldout(self) -> bool:
        return bool(self.heldout)

    def iter_rows(self, epoch: int, stats: StreamStats | None = None) -> Iterator[Row]:
        """Every row of `epoch`, deterministic in (seed, epoch); `stats` fills in as the rows are read."""
        stats = stats if stats is not None else StreamStats()
        rng = np.random.default_rng([self.seed % (1 << 64), epoch % (1 << 64), 0x57AE])
        rejects = None
        if self.config.on_invalid == "skip" and self.spill is None:
            rejects = RejectLog(self.rejects_path, already_written=self._rejects_written)
        if not self._report["read_to_end"]:
            self._live = (stats, epoch)
        try:
            if self.spill is not None:  # read, deduplicated and tokenized once, in `_read_into_spill`
                read = self._spill_stats
                stats.read, stats.dedup = dict(read.read), dict(read.dedup)
                for name in ("heldout_split", "heldout_prompt_overlap_removed", "decontaminated", "truncated",
                             "dropped"):
                    setattr(stats, name, getattr(read, name))
                chunks = self.spill.chunks()
            else:
                samples = stream_samples(self.config, stats, rejects, self.heldout_prompts)
                chunks = stream_tokenized(self.config, self.tokenizer, samples, stats, self.decontaminator)
            mixed = stream_mixed(self.config, chunks, rng, stats, self.rates)
            yield from stream_packed(self.config, mixed, rng, stats)
        finally:
            if rejects is not None:
                rejects.close()
                stats.dedup["rejected"] = rejects.count
                self._rejects_written = max(self._rejects_written, rejects.count)
        if not stats.samples:
            raise DataError("data.train: no training sample left after reading, dedup, decontamination and "
                            "tokenization")
        self._counts[epoch] = stats.rows
        if not self._report["read_to_end"]:
            self._live = None
            self._report.update(stats.report(), epoch=epoch, read_to_end=True)

    def _read_into_spill(self) -> dict[str, int]:
        """The one reading pass of a mixed run: every train sample read, deduplicated, held-out split off,
        decontaminated and tokenized into `self.spill`, counting the samples available per mix group (after
        decontamination, before tokenization: the rates' denominators). The epochs then mix and pack from the
        spill; its counts (read, dedup, rejects, held-out split, ...) are every epoch's."""
        stats, available = self._spill_stats, {}
        if not self.heldout_prompts and self.config.heldout_fraction > 0:
            self._split_off = []
        rejects = RejectLog(self.rejects_path) if self.config.on_invalid == "skip" else None
        self.spill = TokenSpill()
        try:
            samples = stream_samples(self.config, stats, rejects, self.heldout_prompts, self._split_off)
            for chunk, groups in stream_tokenized(self.config, self.tokenizer, samples, stats, self.decontaminator,
                                                  available):
                self.spill.write(chunk, groups)
        finally:
            self.spill.close()
            if rejects is not None:
                rejects.close()
                stats.dedup["rejected"] = self._rejects_written = rejects.count
        return available

    def count_rows(self, epoch: int) -> int:
        """The rows of `epoch`, counted by one streaming pass unless a pass has already read it to its end."""
        if epoch not in self._counts:
            for _ in self.iter_rows(epoch):
                pass
        return self._counts[epoch]

    def known_rows(self, epoch: int) -> int | None:
        """The rows of `epoch` if a pass has read it to its end, else None."""
        return self._counts.get(epoch)

    def collect_heldout(self) -> list[SFTSample]:
        """The samples `heldout_fraction` splits off, the first `stream.heldout_max` of them: a pass that reads
        and deduplicates (dedup decides each sample from those before it, so a prefix decides as the whole
        pass does) and stops once it has them."""
        if self._split_off is not None:  # collected by the reading pass
            return self._split_off
        split_off: list[SFTSample] = []
        rejects = RejectLog(None) if self.config.on_invalid == "skip" else None
        for _ in stream_samples(self.config, StreamStats(), rejects, self.heldout_prompts, split_off):
            if len(split_off) >= self.config.stream.heldout_max:
                break
        return split_off

    def epoch_rows(self, epoch: int) -> RowStream:
        return RowStream(self, epoch)

    def heldout_rows(self) -> list[Row]:
        config = self.config
        return build_epoch(self.heldout, epoch=0, seed=self.seed, max_length=config.max_length, pack=config.pack)


def prepare_streaming_sft_data(config: SFTDataConfig, tokenizer: Any, *, seed: int,
                               rejects_path: Any = None) -> StreamingSFTData:
    """The streaming counterpart of `prepare_sft_data`: held-out sources are read (and tokenized) here, or the
    samples `heldout_fraction` splits off are collected by a partial pass; the train sources are read when the
    rows are (never counted first)."""
    rejects = RejectLog(rejects_path, append=False) if config.on_invalid == "skip" else None
    try:
        given = [s for source in config.heldout for s in iter_samples(source, config.on_invalid, rejects)]
    finally:
        if rejects is not None:
            rejects.close()
    data = StreamingSFTData(config, tokenizer, seed, rejects_path, [], {sample.prompt_text for sample in given})
    if not given and config.heldout_fraction > 0:
        given = data.collect_heldout()
    data.heldout = tokenize_samples(given, tokenizer, config.max_length, config.reasoning).samples
    data._report["heldout"] = {"samples": len(data.heldout)}
    return data
