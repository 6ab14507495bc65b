"""The SFT data pipeline in one call: read -> dedup -> held-out split -> decontaminate -> tokenize; then per epoch
mix -> pack.

    prepared = prepare_sft_data(recipe.data, tokenizer, seed=recipe.runtime.seed, rejects_dir=output_dir)
    rows = prepared.epoch_rows(epoch)          # the trainer's data cursor is (epoch, row index)
    batch = collate(rows[i:i + batch_size], tokenizer.pad_token_id)

Order of the steps, and why:

1. read every train (and held-out) source; invalid records are errors or rejects (`on_invalid`).
2. dedup the train samples (exact, then MinHash near-duplicates), keeping first occurrences.
3. held-out: the given held-out sources, with any train sample sharing a held-out prompt removed; or, when
   none is given, `heldout_fraction` of the prompts split off by hash (`split_by_hash`, fixed salt, so the
   held-out set does not move with the seed).
4. decontaminate the train samples against `decontaminate.against`.
5. tokenize train and held-out once (truncation and drops counted).
6. per epoch: `mix` draws the epoch's samples by metadata weights for (seed, epoch), and `build_epoch`
   shuffles and packs them. Both are pure functions of (seed, epoch), so a resume at (epoch, row) is exact.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from posttrain.config import DataSource, SFTDataConfig
from posttrain.data.decontaminate import decontaminate, read_eval_items
from posttrain.data.dedup import deduplicate
from posttrain.data.mixing import MixResult, mix
from posttrain.data.packing import Row, build_epoch
from posttrain.data.readers import RejectLog, iter_samples, read_samples
from posttrain.data.schema import DataError, SFTSample
from posttrain.data.split import split_by_hash
from posttrain.data.stream import StreamingSFTData, prepare_streaming_sft_data
from posttrain.data.tokenize import TokenizedSample, conversation_for_training, tokenize_samples

REJECTS_FILE = "rejects.jsonl"


@dataclass
class PreparedSFTData:
    train: list[TokenizedSample]
    heldout: list[TokenizedSample]
    config: SFTDataConfig
    seed: int
    report: dict[str, Any] = field(default_factory=dict)
    _cached: tuple[int, list[Row]] | None = field(default=None, init=False, repr=False)

    @property
    def has_heldout(self) -> bool:
        return bool(self.heldout)

    def epoch_mix(self, epoch: int) -> MixResult:
        return mix(self.train, self.config.mix, seed=self.seed, epoch=epoch)

    def epoch_rows(self, epoch: int) -> list[Row]:
        """The rows of `epoch`: re-drawn mixture, shuffled and packed, the same every time it is asked."""
        if self._cached is None or self._cached[0] != epoch:
            samples = self.epoch_mix(epoch).samples
            rows = build_epoch(
                samples, epoch=epoch, seed=self.seed, max_length=self.config.max_length, pack=self.config.pack
            )
            self._cached = (epoch, rows)
        return self._cached[1]

    def heldout_rows(self) -> list[Row]:
        """Held-out rows for the eval loss: every held-out sample once, in a fixed order."""
        config = self.config
        return build_epoch(self.heldout, epoch=0, seed=self.seed, max_length=config.max_length, pack=config.pack)


def prepare_sft_data(
    config: SFTDataConfig, tokenizer: Any, *, seed: int, rejects_dir: str | Path | None = None
) -> PreparedSFTData | StreamingSFTData:
    """Run steps 1-5 of the module docstring; `report` holds every count and the epoch-0 mixture.
    With ``config.streaming`` the same steps run incrementally (`posttrain.data.stream`)."""
    if not config.train:
        raise DataError("data.train: no training source given")
    if config.on_invalid == "skip" and rejects_dir is None:
        raise DataError("data.on_invalid: skip needs a rejects_dir to write the rejected records to")
    if config.streaming:
        rejects_path = Path(rejects_dir) / REJECTS_FILE if rejects_dir is not None else None
        return prepare_streaming_sft_data(config, tokenizer, seed=seed, rejects_path=rejects_path)
    # A fresh file per preparation: a re-run (or a resume) must not pile up the same rejects twice.
    rejects = RejectLog(Path(rejects_dir) / REJECTS_FILE, append=False) if config.on_invalid == "skip" else None
    try:
        train, read_counts = _read_all(config.train, config, rejects)
        given_heldout, heldout_counts = _read_all(config.heldout, config, rejects)
    finally:
        if rejects is not None:
            rejects.close()
    report: dict[str, Any] = {
        "read": read_counts,
        "read_total": sum(read_counts.values()),
        "heldout_read": heldout_counts,
        "rejected": rejects.count if rejects else 0,
        "rejects_file": str(rejects.path) if rejects and rejects.count else None,
    }

    deduped = deduplicate(train, config.dedup)
    report.update(deduped.report())
    train, heldout, overlap = _split_heldout(deduped.samples, given_heldout, config.heldout_fraction)
    report["heldout_prompt_overlap_removed"] = overlap

    if config.decontaminate.against:
        eval_items = [item for source in config.decontaminate.against for item in read_eval_items(source)]
        clean = decontaminate(train, eval_items, tokenizer, config.decontaminate.ngram)
        train = clean.samples
        report["decontamination"] = clean.report()
    report["decontaminated"] = report.get("decontamination", {}).get("removed", 0)

    tokenized = tokenize_samples(train, tokenizer, config.max_length, config.reasoning)
    tokenized_heldout = tokenize_samples(heldout, tokenizer, config.max_length, config.reasoning)
    if not tokenized.samples:
        raise DataError("data.train: no training sample left after reading, dedup, decontamination and tokenization")
    report["truncated"], report["dropped"] = tokenized.truncated, tokenized.dropped
    report["train"] = {"samples": len(tokenized.samples), **tokenized.report()}
    report["heldout"] = {"samples": len(tokenized_heldout.samples), **tokenized_heldout.report()}
    prepared = PreparedSFTData(tokenized.samples, tokenized_heldout.samples, config, seed, report)
    report["mixture"] = prepared.epoch_mix(0).report()
    return prepared


def read_all_texts(config: SFTDataConfig) -> list[str]:
    """Every message content, tool call and reasoning trace of the train and held-out sources: the corpus the
    built-in tokenizer is trained on before `prepare_sft_data` runs. Invalid records are passed over here;
    `prepare_sft_data` reads the sources again and reports (or rejects) them. A streaming run takes the first
    `data.stream.tokenizer_texts` texts only (a tokenizer needs a sample of the text, not all of it)."""
    if config.streaming:
        return list(itertools.islice(iter_texts(config), config.stream.tokenizer_texts))
    return list(iter_texts(config))


def iter_texts(config: SFTDataConfig) -> Iterator[str]:
    """`read_all_texts` one text at a time (what a streaming run trains its tokenizer on, bounded)."""
    for source in [*config.train, *config.heldout]:
        # The same readers and format conversion as training (a bad line is passed over, never a traceback);
        # rejects only counted here, in a throwaway log: prepare_sft_data reads again and reports them.
        for sample in iter_samples(source, on_invalid="skip", rejects=RejectLog(None)):
            for message in conversation_for_training(sample, config.reasoning):
                yield message.get("content") or ""
                if message.get("tool_calls"):
                    yield json.dumps(message["tool_calls"], ensure_ascii=False)


def _read_all(
    sources: list[DataSource], config: SFTDataConfig, rejects: RejectLog | None
) -> tuple[list[SFTSample], dict[str, int]]:
    samples: list[SFTSample] = []
    counts: dict[str, int] = {}
    for source in sources:
        read = read_samples(source, config.on_invalid, rejects)
        counts[source.name] = len(read)
        samples.extend(read)
    return samples, counts


def _split_heldout(
    train: list[SFTSample], given: list[SFTSample], fraction: float
) -> tuple[list[SFTSample], list[SFTSample], int]:
    """(train, heldout, how many train samples were removed for sharing a prompt with a given held-out one)."""
    if given:
        heldout_prompts = {sample.prompt_text for sample in given}
        kept = [sample for sample in train if sample.prompt_text not in heldout_prompts]
        return kept, given, len(train) - len(kept)
    if fraction > 0:
        train, heldout = split_by_hash(train, fraction)
        return train, heldout, 0
    return train, [], 0
