"""Preference pairs: a prompt, a chosen and a rejected response, plus metadata — read, validated, tokenized.

A record on disk (one JSONL line, one Parquet row, one dataset row):

    {"prompt": [{"role": "user", "content": "12+34"}],
     "chosen": {"role": "assistant", "content": "46"},
     "rejected": {"role": "assistant", "content": "45"},
     "metadata": {"domain": "arithmetic", "difficulty": 2, "source": "generated"}}

`prompt` is a list of messages (a plain string is shorthand for one user message). `chosen` and `rejected`
are each one assistant message, a list of messages (a multi-turn response: assistant turns with tool results
between them), or a plain string (shorthand for one assistant message). Metadata is the SFT sample's.
Without a `prompt`, `chosen` and `rejected` are whole conversations sharing their first turns (the
UltraFeedback-binarized layout): the shared turns are the prompt. Scores (`score_chosen`, `score_rejected`)
are kept in the metadata. Column and metadata mappings: `posttrain.data.formats`.

The same readers and error rules as SFT data (`posttrain.data.read_records`): an invalid record is a
`DataError` naming `file:line: field: problem` (`file:row N` for Parquet and saved datasets), or with
`on_invalid: skip` it is left out, counted, and written to `rejects.jsonl` — never silently.

Tokenization is SFT's (`posttrain.data.tokenize_samples`): prompt + response rendered through the chat
template, loss mask on assistant replies. Only the response's assistant replies are scored (the mask is
cleared over the prompt, which may hold earlier assistant turns); tool results inside a response are context.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.config import DataSource, PreferenceDataConfig
from posttrain.data import (
    DataError,
    RecordError,
    RejectLog,
    SampleMetadata,
    SFTSample,
    TokenizedSample,
    prompt_fraction,
    prompt_ids,
    read_records,
    tokenize_samples,
)
from posttrain.data.formats import SourceFormat
from posttrain.data.readers import source_label
from posttrain.data.schema import _validate_message, _validate_metadata
from posttrain.types import Message

RESPONSE_ROLES = ("assistant", "tool")
REJECTS_FILE = "rejects.jsonl"


@dataclass
class PreferencePair:
    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]
    metadata: SampleMetadata = field(default_factory=SampleMetadata)
    origin: str = ""  # "file:line", for errors found after reading

    @property
    def prompt_text(self) -> str:
        """The prompt's identity, used for held-out splits."""
        return "\n".join(f"{m['role']}:{m.get('content') or ''}" for m in self.prompt)

    def to_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "chosen": self.chosen, "rejected": self.rejected,
                "metadata": self.metadata.to_dict()}


@dataclass
class TokenizedPair:
    """Token ids of prompt + chosen and prompt + rejected; the masks mark the scored (response) tokens."""

    prompt_length: int
    chosen_ids: list[int]
    rejected_ids: list[int]
    chosen_mask: list[int]
    rejected_mask: list[int]
    truncated: bool = False


@dataclass
class PreferenceData:
    train: list[PreferencePair]
    heldout: list[PreferencePair]
    report: dict[str, Any]


# ----------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------


def validate_pair_record(record: Any, default_source: str | None = None) -> PreferencePair:
    """Check one raw record and build the pair; raise `RecordError` naming the offending field."""
    if not isinstance(record, dict):
        raise RecordError("<record>", f"expected an object, got {type(record).__name__}")
    for key in ("prompt", "chosen", "rejected"):
        if record.get(key) is None:
            raise RecordError(key, "missing")
    prompt = _validate_prompt(record["prompt"])
    chosen = _validate_response(record["chosen"], "chosen")
    rejected = _validate_response(record["rejected"], "rejected")
    if chosen == rejected:
        raise RecordError("rejected", "identical to chosen (the pair teaches nothing)")
    meta = record.get("metadata", {}) or {}
    if not isinstance(meta, dict):
        raise RecordError("metadata", f"expected an object, got {type(meta).__name__}")
    return PreferencePair(prompt, chosen, rejected, _validate_metadata(meta, default_source))


def _validate_prompt(prompt: Any) -> list[Message]:
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise RecordError("prompt", "expected a non-empty list of {role, content} objects (or a string)")
    messages = [_validate_message(_without_nulls(message), f"prompt[{i}]") for i, message in enumerate(prompt)]
    if messages[-1]["role"] == "assistant":
        raise RecordError(f"prompt[{len(messages) - 1}].role", "the prompt must not end with an assistant turn "
                          "(the response is what follows it)")
    return messages


def _validate_response(response: Any, key: str) -> list[Message]:
    if isinstance(response, str):
        response = {"role": "assistant", "content": response}
    if isinstance(response, dict):
        response, single = [response], True
    else:
        single = False
    if not isinstance(response, list) or not response:
        raise RecordError(key, "expected an assistant message, a list of messages, or a string")
    messages = []
    for i, message in enumerate(response):
        where = key if single else f"{key}[{i}]"
        clean = _validate_message(_without_nulls(message), where)
        if clean["role"] not in RESPONSE_ROLES:
            raise RecordError(f"{where}.role", f"a response holds assistant (and tool) turns, got {clean['role']!r}")
        messages.append(clean)
    if messages[0]["role"] != "assistant":
        raise RecordError(f"{key}[0].role" if not single else f"{key}.role", "a response starts with an assistant turn")
    return messages


def _without_nulls(message: Any) -> Any:
    # Arrow unifies struct fields across rows: a message without `tool_calls` reads back from Parquet with
    # `tool_calls: None`. A null field means the field is absent.
    return {k: v for k, v in message.items() if v is not None} if isinstance(message, dict) else message


# ----------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------


def read_preference_pairs(
    source: DataSource, *, on_invalid: str = "error", rejects: RejectLog | None = None
) -> list[PreferencePair]:
    """Every valid pair of one source (JSONL, Parquet, CSV, a saved or an `hf` dataset), in file order.

    Records are explicit (prompt, chosen, rejected) or implicit (chosen and rejected whole conversations
    sharing their prompt turns), through the source's `columns` and `metadata` mappings
    (`posttrain.data.formats`); each pair's `origin` is its ``file:line``."""
    default_source = source.source or source_label(source)
    converter = SourceFormat(columns=source.columns, metadata=source.metadata)
    pairs = []
    for location, record in read_records(source, on_invalid=on_invalid, rejects=rejects):  # type: ignore[arg-type]
        where = f"{source.name}:{location}"
        try:
            pair = validate_pair_record(converter.to_pair(record), default_source)
        except RecordError as error:
            if on_invalid != "skip" or rejects is None:
                raise DataError(f"{where}: {error}") from None
            rejects.add(source.name, location, str(error), record)
            continue
        pair.origin = where
        pair.metadata.origin = where
        pairs.append(pair)
    return pairs


def load_preference_data(config: PreferenceDataConfig, rejects_dir: Path | None = None) -> PreferenceData:
    """Train and held-out pairs of a recipe's `data` section.

    Held-out: the given sources, with train pairs sharing a held-out prompt removed; or, when none is given,
    `heldout_fraction` of the prompts split off by SFT's stable prompt hash.
    """
    if not config.train:
        raise DataError("data.train: no training data (add a source: data.train: [{path: pairs.jsonl}])")
    if config.on_invalid == "skip" and rejects_dir is None:
        raise DataError("data.on_invalid: skip needs a rejects_dir to write the rejected records to")
    rejects = RejectLog(Path(rejects_dir) / REJECTS_FILE, append=False) if config.on_invalid == "skip" else None
    try:
        train = [p for s in config.train for p in read_preference_pairs(s, on_invalid=config.on_invalid,
                                                                        rejects=rejects)]
        heldout = [p for s in config.heldout for p in read_preference_pairs(s, on_invalid=config.on_invalid,
                                                                            rejects=rejects)]
    finally:
        if rejects is not None:
            rejects.close()
    overlap = 0
    if heldout:
        heldout_prompts = {p.prompt_text for p in heldout}
        kept = [p for p in train if p.prompt_text not in heldout_prompts]
        overlap, train = len(train) - len(kept), kept
    elif config.heldout_fraction > 0:
        heldout = [p for p in train if prompt_fraction(p.prompt_text) < config.heldout_fraction]
        train = [p for p in train if prompt_fraction(p.prompt_text) >= config.heldout_fraction]
    if not train:
        raise DataError("data.train: no valid training pairs" + (" (all were rejected)" if rejects and rejects.count
                                                                  else ""))
    report = {"pairs": {"train": len(train), "heldout": len(heldout)}, "rejected": rejects.count if rejects else 0,
              "train_sharing_heldout_prompt": overlap}
    return PreferenceData(train=train, heldout=heldout, report=report)


def pair_texts(data: PreferenceData) -> list[str]:
    """Every message text of the pairs (what the built-in tokenizer is trained on)."""
    return [m.get("content") or "" for pair in data.train + data.heldout
            for m in pair.prompt + pair.chosen + pair.rejected]


# ----------------------------------------------------------------------------------------------------
# Tokenization and batching
# ----------------------------------------------------------------------------------------------------


def tokenize_pairs(
    pairs: list[PreferencePair], tokenizer, max_length: int, *, on_invalid: str = "error"
) -> tuple[list[PreferencePair], list[TokenizedPair], int]:
    """Tokenize `pairs`; returns the pairs kept, their tokens, and how many were truncated.

    A sequence longer than `max_length` is cut at the end. A pair whose prompt leaves no room for a scored
    response token is an error naming its origin, or left out under `on_invalid: skip`.
    """
    if not pairs:
        return [], [], 0
    conversations = [SFTSample(pair.prompt + response, pair.metadata)
                     for pair in pairs for response in (pair.chosen, pair.rejected)]
    # No truncation here (it is decided per pair below) and no reasoning trace (a pair's responses hold theirs).
    # Only the response is located: a template may rewrite the prompt's earlier turns (Qwen3 drops their
    # thinking) as long as it renders the same prompt before either response.
    result = tokenize_samples(conversations, tokenizer, max_length=sys.maxsize, reasoning="drop",
                              keep_empty=True, trained_from=[len(pair.prompt) for pair in pairs for _ in "cr"])
    tokenized: list[list[TokenizedSample]] = [[] for _ in conversations]
    for source, sample in zip(result.sources, result.samples):
        tokenized[source].append(sample)
    prompts = prompt_ids(tokenizer, [pair.prompt for pair in pairs])
    kept, tokens, truncated = [], [], 0
    for index, (pair, prompt) in enumerate(zip(pairs, prompts)):
        try:
            pair_tokens = _pair_tokens(prompt, _one(tokenized[2 * index], "chosen"),
                                       _one(tokenized[2 * index + 1], "rejected"), max_length)
        except RecordError as error:
            if on_invalid != "skip":
                raise DataError(f"{pair.origin or f'pair {index}'}: {error}") from None
            continue
        kept.append(pair)
        tokens.append(pair_tokens)
        truncated += pair_tokens.truncated
    return kept, tokens, truncated


def tokenize_pair(pair: PreferencePair, tokenizer, max_length: int) -> TokenizedPair:
    """One pair (see `tokenize_pairs`); raises `DataError` when it does not fit."""
    return tokenize_pairs([pair], tokenizer, max_length)[1][0]


def _one(sequences: list[TokenizedSample], key: str) -> TokenizedSample:
    if len(sequences) != 1:
        raise RecordError(key, "the chat template renders this response's turns as separate sequences (it "
                          "rewrites earlier ones); give a single-turn response, or a template that does not")
    return sequences[0]


def _pair_tokens(prompt_ids: list[int], chosen, rejected, max_length: int) -> TokenizedPair:
    prompt_length = len(prompt_ids)
    if prompt_length >= max_length:
        raise RecordError("prompt", f"{prompt_length} tokens leave no room for a response within "
                          f"data.max_length={max_length}")
    sequences = []
    for key, sample in (("chosen", chosen), ("rejected", rejected)):
        if sample.input_ids[:prompt_length] != prompt_ids:
            raise RecordError(key, "the response changes how the prompt tokenizes (a token merges across the "
                              "boundary); end the prompt with the chat template's generation prompt")
        ids = sample.input_ids[:max_length]
        mask = [0] * prompt_length + sample.loss_mask[prompt_length:max_length]
        if not any(mask):
            raise RecordError(key, f"no assistant tokens within data.max_length={max_length}")
        sequences.append((ids, mask))
    (chosen_ids, chosen_mask), (rejected_ids, rejected_mask) = sequences
    truncated = max(len(chosen.input_ids), len(rejected.input_ids)) > max_length
    return TokenizedPair(prompt_length, chosen_ids, rejected_ids, chosen_mask, rejected_mask, truncated)


# A separate forward costs about as much as this many extra padded tokens (per-op overhead, measured on the
# tiny models on CPU); a length group is split off only when it saves more padding than that.
GROUP_OVERHEAD_TOKENS = 128
MAX_LENGTH_GROUPS = 4


def collate_pairs(
    pairs: list[TokenizedPair], pad_id: int, device: torch.device | str = "cpu", *, max_groups: int = MAX_LENGTH_GROUPS
) -> dict[str, Any]:
    """One batch of 2B sequences, prompt+chosen as rows 0..B-1 and prompt+rejected as rows B..2B-1, in up to
    `max_groups` length groups, each a right-padded tensor for its own forward.

    Grouping by length keeps the padding small (mixed lengths padded to the longest waste a fifth of the
    compute on 2- and 3-digit sums, more on real data) without changing what a step computes: the per-row
    results are put back in row order before the loss. Right padding keeps every real token's position and
    means no real token attends to padding under a causal mask, so no attention mask is needed.

    Each group: `input_ids [n, T]`, `select [n, T-1]` (positions whose next token is scored), `targets` (those
    tokens), `row_index` (the batch row of each selected position, in order), `rows [n]` (the batch rows of
    the group), `last_index [n]` (each row's last real token). The batch: `groups`, `token_counts [2B]`
    (scored tokens per row), `num_pairs`, `num_rows`, `num_tokens` (real tokens).
    """
    sequences = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    masks = [p.chosen_mask for p in pairs] + [p.rejected_mask for p in pairs]
    lengths = [len(ids) for ids in sequences]
    groups = []
    for rows in length_groups(lengths, max_groups):
        width = max(lengths[r] for r in rows)
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        scored = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):
            input_ids[i, : lengths[r]] = torch.tensor(sequences[r])
            scored[i, : lengths[r]] = torch.tensor(masks[r], dtype=torch.bool)
        select = scored[:, 1:]
        rows_tensor = torch.tensor(rows)
        groups.append({
            "input_ids": input_ids.to(device),
            "select": select.to(device),
            "targets": input_ids[:, 1:][select].to(device),
            "row_index": rows_tensor[select.nonzero()[:, 0]].to(device),
            "rows": rows_tensor.to(device),
            "last_index": torch.tensor([lengths[r] - 1 for r in rows], device=device),
        })
    return {
        "groups": groups,
        "token_counts": torch.tensor([sum(mask[1:]) for mask in masks], device=device),
        "num_pairs": len(pairs),
        "num_rows": len(sequences),
        "num_tokens": sum(lengths),
    }


def length_groups(lengths: list[int], max_groups: int = MAX_LENGTH_GROUPS,
                  overhead_tokens: int = GROUP_OVERHEAD_TOKENS) -> list[list[int]]:
    """Row indices cut into up to `max_groups` groups of similar length (padded tokens + per-group overhead
    kept low): greedily split the group at the cut that saves the most padding, while that beats the overhead."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    ordered = [lengths[i] for i in order]
    spans = [(0, len(order))]
    while len(spans) < max_groups:
        best_saving, best = overhead_tokens, None
        for index, (low, high) in enumerate(spans):
            top = ordered[high - 1]
            for cut in range(low + 1, high):
                saving = (cut - low) * (top - ordered[cut - 1])  # the short part no longer padded to `top`
                if saving > best_saving:
                    best_saving, best = saving, (index, cut)
        if best is None:
            break
        index, cut = best
        low, high = spans[index]
        spans[index : index + 1] = [(low, cut), (cut, high)]
    return [order[low:high] for low, high in spans]
