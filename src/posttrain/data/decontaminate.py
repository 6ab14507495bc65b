"""Decontamination: drop training samples that overlap evaluation items.

Two tests, either one contaminates:

* n-gram overlap on token ids: the sample shares at least one n-gram (default n = 13, the GPT-3 report's
  choice) with an eval item. Items shorter than n have no n-gram and are caught by the next test only.
* exact prompt: the sample's normalized prompt (its user turns before the first reply, normalized as in
  `posttrain.data.dedup.normalize_text`) equals an eval item's.

`NgramIndex` works on token ids from any tokenizer and is what the evaluation room reuses for its contamination
report: ``index = NgramIndex(13); index.add(ids, key="gsm8k/17"); index.overlaps(other_ids) -> ["gsm8k/17"]``.
An n-gram is stored as a 64-bit polynomial hash of its ids (computed for all windows at once with numpy); two
different n-grams collide with probability about 2^-64 per pair.

Eval sets are JSONL, Parquet or saved datasets of chat samples (``messages``; no reply needed) or tasks
(``messages`` or ``prompt``), with an optional ``id`` and ``answer``; their text is every message's content
plus the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from posttrain.config import DataSource
from posttrain.data.dedup import normalize_text
from posttrain.data.readers import read_records, where
from posttrain.data.schema import DataError, SFTSample
from posttrain.types import Message

_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd, so the hash is a bijection on each new id


def ngram_hashes(ids: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """The uint64 hash of every length-n window of `ids` (empty when there are fewer than n ids)."""
    ids = np.asarray(ids, dtype=np.uint64)
    windows = len(ids) - n + 1
    if windows <= 0:
        return np.empty(0, dtype=np.uint64)
    hashes = np.zeros(windows, dtype=np.uint64)
    with np.errstate(over="ignore"):  # wrap-around is the point: arithmetic modulo 2^64
        for j in range(n):
            hashes = hashes * _MULTIPLIER + ids[j : j + windows] + np.uint64(1)
    return hashes


class NgramIndex:
    """A set of token n-grams, each remembering the first item (key) it came from."""

    def __init__(self, n: int = 13):
        if n <= 0:
            raise ValueError(f"n must be positive, got {n}")
        self.n = n
        self._owner: dict[int, str] = {}
        self._sorted: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self._owner)

    def add(self, ids: Sequence[int], key: str = "") -> int:
        """Index every n-gram of `ids` under `key`; returns how many n-grams were new."""
        before = len(self._owner)
        for value in ngram_hashes(ids, self.n).tolist():
            self._owner.setdefault(value, key)
        self._sorted = None
        return len(self._owner) - before

    def overlaps(self, ids: Sequence[int]) -> list[str]:
        """The keys of the indexed items sharing at least one n-gram with `ids` (sorted; empty if none)."""
        return self.overlaps_many([ids])[0]

    def overlaps_many(self, sequences: Iterable[Sequence[int]]) -> list[list[str]]:
        """`overlaps` for many sequences, hashed and looked up in one vectorized pass."""
        sequences = list(sequences)
        hashes = [ngram_hashes(ids, self.n) for ids in sequences]
        if not self._owner or not sequences:
            return [[] for _ in sequences]
        if self._sorted is None:
            self._sorted = np.sort(np.fromiter(self._owner, dtype=np.uint64, count=len(self._owner)))
        flat = np.concatenate(hashes)
        hit = np.isin(flat, self._sorted, assume_unique=False)
        results, start = [], 0
        for h in hashes:
            found = h[hit[start : start + len(h)]]
            results.append(sorted({self._owner[int(v)] for v in found}))
            start += len(h)
        return results


@dataclass
class EvalItem:
    key: str  # the record's id, or file:line
    text: str  # what n-grams are taken from
    prompt: str  # normalized user turns: what the exact test compares


@dataclass
class DecontaminationResult:
    samples: list[SFTSample]
    contaminated: list[dict[str, Any]] = field(default_factory=list)  # {sample, source, reason, eval_items}
    eval_items: int = 0
    ngram: int = 13

    def report(self) -> dict[str, Any]:
        return {
            "eval_items": self.eval_items,
            "ngram": self.ngram,
            "removed": len(self.contaminated),
            "contaminated": self.contaminated,
        }


def read_eval_items(source: DataSource | str | Path) -> list[EvalItem]:
    """Read an eval set (chat samples or tasks) as items to decontaminate against."""
    if not isinstance(source, DataSource):
        source = DataSource(path=str(source))
    items = []
    for location, record in read_records(source):
        items.append(_eval_item(record, where(source.name, location)))
    return items


def _eval_item(record: dict[str, Any], location: str) -> EvalItem:
    messages = record.get("messages")
    if messages is None and isinstance(record.get("prompt"), str):
        messages = [{"role": "user", "content": record["prompt"]}]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise DataError(f"{location}: messages: expected a list of {{role, content}} objects (or a prompt string)")
    contents = [str(m.get("content") or "") for m in messages]
    if isinstance(record.get("answer"), str):
        contents.append(record["answer"])
    key = str(record["id"]) if record.get("id") is not None else location
    return EvalItem(key=key, text="\n".join(contents), prompt=prompt_key(messages))


def prompt_key(messages: Sequence[Message]) -> str:
    """The normalized user turns before the first assistant reply (system prompts differ between sets)."""
    users = []
    for message in messages:
        if message.get("role") == "assistant":
            break
        if message.get("role") == "user":
            users.append(normalize_text(str(message.get("content") or "")))
    return "\n".join(users)


def sample_text(sample: SFTSample) -> str:
    """Every message's content and the reasoning trace: the text a training sample's n-grams come from."""
    parts = [str(m.get("content") or "") for m in sample.messages]
    if sample.metadata.reasoning_trace:
        parts.append(sample.metadata.reasoning_trace)
    return "\n".join(parts)


def decontaminate(
    samples: Sequence[SFTSample], eval_items: Sequence[EvalItem], tokenizer: Any, ngram: int = 13
) -> DecontaminationResult:
    """Keep the samples that share no `ngram`-token n-gram and no normalized prompt with any eval item."""
    return Decontaminator(eval_items, tokenizer, ngram).check(samples)


class Decontaminator:
    """The eval items' n-gram index and prompts, built once; `check` a list (or a stream's chunks) against them.

    Its memory is that of the eval sets (one 8-byte hash per distinct eval n-gram, one prompt per item),
    whatever the amount of training data checked."""

    def __init__(self, eval_items: Sequence[EvalItem], tokenizer: Any, ngram: int = 13):
        self.tokenizer, self.ngram, self.num_items = tokenizer, ngram, len(eval_items)
        self.index = NgramIndex(ngram)
        for item, ids in zip(eval_items, _token_ids([item.text for item in eval_items], tokenizer)):
            self.index.add(ids, item.key)
        self.prompts: dict[str, str] = {}
        for item in eval_items:
            if item.prompt:
                self.prompts.setdefault(item.prompt, item.key)

    def check(self, samples: Sequence[SFTSample]) -> DecontaminationResult:
        if not self.num_items:
            return DecontaminationResult(samples=list(samples), ngram=self.ngram)
        overlaps = self.index.overlaps_many(_token_ids([sample_text(s) for s in samples], self.tokenizer))
        kept, contaminated = [], []
        for position, (sample, ngram_hits) in enumerate(zip(samples, overlaps)):
            prompt_hit = self.prompts.get(prompt_key(sample.messages))
            if not ngram_hits and prompt_hit is None:
                kept.append(sample)
                continue
            reasons = (["ngram"] if ngram_hits else []) + (["exact_prompt"] if prompt_hit is not None else [])
            contaminated.append(
                {
                    "sample": position,
                    "source": sample.metadata.source,
                    "origin": sample.metadata.origin,
                    "reason": "+".join(reasons),
                    "eval_items": sorted(set(ngram_hits) | ({prompt_hit} if prompt_hit is not None else set())),
                    "prompt": sample.prompt_text[:200],
                }
            )
        return DecontaminationResult(samples=kept, contaminated=contaminated, eval_items=self.num_items,
                                     ngram=self.ngram)


def _token_ids(texts: list[str], tokenizer: Any) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False)["input_ids"]
