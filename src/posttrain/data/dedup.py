"""Duplicate removal: exact (normalized conversation text) and near-duplicates (MinHash LSH on character shingles).

Normalization (`normalize_text`): Unicode NFKC, case-folded, every run of whitespace one space, stripped. The
conversation text is every message as ``role: content`` plus its tool calls (JSON with sorted keys), one per line;
metadata (the reasoning trace included) is not part of a sample's identity.

Near-duplicates: the set of k-character shingles of that text is summarized by a MinHash signature
(datasketch, `num_perm` permutations, fixed seed), and an LSH index (datasketch's banding for `threshold`)
proposes candidates; a candidate counts only if the signatures' estimated Jaccard similarity reaches
`threshold`. Samples are visited in order and the first occurrence is kept, so the result is deterministic.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from typing import Sequence

from datasketch import MinHash, MinHashLSH

from posttrain.config import DedupConfig
from posttrain.data.schema import SFTSample
from posttrain.types import Message

_SPACES = re.compile(r"\s+")
_MINHASH_SEED = 1


def normalize_text(text: str) -> str:
    return _SPACES.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def conversation_text(messages: Sequence[Message]) -> str:
    """The normalized text of a whole conversation: what exact and near dedup compare."""
    lines = []
    for message in messages:
        line = f"{message['role']}: {normalize_text(message.get('content') or '')}"
        if message.get("tool_calls"):
            line += " " + normalize_text(json.dumps(message["tool_calls"], sort_keys=True, ensure_ascii=False))
        lines.append(line)
    return "\n".join(lines)


@dataclass
class DedupResult:
    samples: list[SFTSample]
    exact_duplicates: int
    near_duplicates: int

    def report(self) -> dict[str, int]:
        return {"exact_duplicates": self.exact_duplicates, "near_duplicates": self.near_duplicates}


def deduplicate(samples: Sequence[SFTSample], config: DedupConfig = DedupConfig()) -> DedupResult:
    """Drop exact then near duplicates (as `config` asks), keeping each first occurrence."""
    texts = [conversation_text(sample.messages) for sample in samples]
    keep = list(range(len(samples)))
    exact = near = 0
    if config.exact:
        keep = _first_of_each_text(texts, keep)
        exact = len(samples) - len(keep)
    if config.near:
        before = len(keep)
        keep = _first_of_each_near(texts, keep, config)
        near = before - len(keep)
    return DedupResult(samples=[samples[i] for i in keep], exact_duplicates=exact, near_duplicates=near)


def _first_of_each_text(texts: list[str], indices: list[int]) -> list[int]:
    seen: set[str] = set()
    kept = []
    for index in indices:
        if texts[index] not in seen:
            seen.add(texts[index])
            kept.append(index)
    return kept


def _first_of_each_near(texts: list[str], indices: list[int], config: DedupConfig) -> list[int]:
    signatures = MinHash.bulk(
        [_shingles(texts[i], config.shingle) for i in indices], num_perm=config.num_perm, seed=_MINHASH_SEED
    )
    index = MinHashLSH(threshold=config.threshold, num_perm=config.num_perm)
    kept_signatures: dict[str, MinHash] = {}
    kept = []
    for position, signature in zip(indices, signatures):
        candidates = index.query(signature)
        # LSH banding only proposes; confirm with the estimated Jaccard so `threshold` means what it says.
        if any(signature.jaccard(kept_signatures[key]) >= config.threshold for key in candidates):
            continue
        key = str(position)
        index.insert(key, signature)
        kept_signatures[key] = signature
        kept.append(position)
    return kept


def _shingles(text: str, size: int) -> list[bytes]:
    if len(text) <= size:
        return [text.encode()]
    return list({text[i : i + size].encode() for i in range(len(text) - size + 1)})
