"""Image chats and image preference pairs as the `sft` and `dpo` recipes read them for a vision-language policy.

    data = read_vision_sft_data(recipe.data, rejects_dir=run_dir)        # VisionData: train, heldout, report
    pairs = read_vision_pair_data(recipe.data, rejects_dir=run_dir)     # VisionData of VisionPairSample

SFT records are the chats `posttrain.data.images` reads (OpenAI-style image parts: a file relative to the data file,
a ``file://`` or ``data:`` URL, or a datasets ``Image`` column). A preference record holds its image in the shared
prompt, as TRL's vision DPO format does:

    {"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}},
                                             {"type": "text", "text": "What colour?"}]}],
     "chosen": "red", "rejected": [{"role": "assistant", "content": "blue"}], "images": [...optional column]}

`chosen` and `rejected` are a string, an assistant message or a list of one; images never sit in a reply.
A bad record is the same one-line error as for text data, naming the file, the line and the field
(``pairs.jsonl:3: prompt[0].content[0]: no such image file 'a.png'``); `on_invalid: skip` writes it to the rejects
file instead.

Held-out split (`heldout_fraction`, no held-out source given): by the stable hash of the prompt's text *and its
images' pixels* (`vision_prompt_key`), since image tasks often share one question ("What colour is the largest
shape?") across every record: a split on the text alone would put them all on one side. Exact duplicates (the same
chat and the same pixels) are dropped when `dedup.exact` is on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generic, Sequence, TypeVar

from posttrain.config import DataSource, PreferenceDataConfig, SFTDataConfig
from posttrain.data.images import VisionSample, _printable, validate_vision_record
from posttrain.data.readers import RejectLog, read_records, resolve_path, where
from posttrain.data.schema import DataError, RecordError, SampleMetadata, _validate_metadata
from posttrain.data.split import prompt_fraction
from posttrain.types import Message

if TYPE_CHECKING:
    from PIL import Image

REJECTS_FILE = "rejects.jsonl"
Item = TypeVar("Item")


@dataclass
class VisionPairSample:
    """A preference pair on an image prompt: the prompt turns (text and ``{"type": "image"}`` parts), their images,
    and the chosen and the rejected reply (text)."""

    prompt: list[Message]
    images: list[Image.Image]
    chosen: str
    rejected: str
    metadata: SampleMetadata = field(default_factory=SampleMetadata)


@dataclass
class VisionData(Generic[Item]):
    train: list[Item]
    heldout: list[Item]
    report: dict[str, Any] = field(default_factory=dict)


def vision_prompt_key(messages: Sequence[Message], images: Sequence[Image.Image]) -> str:
    """The prompt's text parts and its images' pixels, as one string (the held-out split's and dedup's key)."""
    digest = hashlib.sha256()
    for image in images:
        digest.update(f"{image.width}x{image.height}".encode())
        digest.update(image.tobytes())
    text = json.dumps([[part.get("text", "<image>") for part in m["content"]] for m in messages
                       if m["role"] != "assistant"], ensure_ascii=False)
    return f"{text}\x1f{digest.hexdigest()}"


def validate_vision_pair(record: Any, *, base_dir: str | Path | None = None,
                         default_source: str | None = None) -> VisionPairSample:
    """Check one raw preference record with an image prompt and load its images; `RecordError` names the field."""
    if not isinstance(record, dict):
        raise RecordError("<record>", f"expected an object, got {type(record).__name__}")
    for key in ("prompt", "chosen", "rejected"):
        if record.get(key) is None:
            raise RecordError(key, "missing")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise RecordError("prompt", "expected a non-empty list of {role, content} objects (or a string)")
    columns = {key: record[key] for key in ("images", "image") if record.get(key) is not None}
    try:
        sample = validate_vision_record({"messages": prompt, **columns}, base_dir=base_dir,
                                        require_assistant=False)
    except RecordError as error:  # the chat reader names its list `messages`; here it is the prompt
        raise RecordError(error.field.replace("messages", "prompt", 1), error.problem) from None
    if sample.messages[-1]["role"] == "assistant":
        raise RecordError(f"prompt[{len(prompt) - 1}].role", "the prompt must not end with an assistant turn "
                          "(the response is what follows it)")
    chosen, rejected = _reply(record["chosen"], "chosen"), _reply(record["rejected"], "rejected")
    if chosen == rejected:
        raise RecordError("rejected", "identical to chosen (the pair teaches nothing)")
    meta = record.get("metadata", {}) or {}
    if not isinstance(meta, dict):
        raise RecordError("metadata", f"expected an object, got {type(meta).__name__}")
    return VisionPairSample(sample.messages, sample.images, chosen, rejected,
                            _validate_metadata(meta, default_source))


def _reply(value: Any, key: str) -> str:
    """A reply's text: a string, an assistant message, or a list of one assistant message."""
    single = value
    if isinstance(value, list):
        if len(value) != 1:
            raise RecordError(key, f"expected one assistant message, got a list of {len(value)} (multi-turn "
                              "replies on an image prompt are not supported)")
        single, key = value[0], f"{key}[0]"
    if isinstance(single, str):
        return single
    if not isinstance(single, dict) or single.get("role") != "assistant":
        raise RecordError(key, "expected a string or an assistant message {role: assistant, content: ...}")
    content = single.get("content")
    if isinstance(content, list):  # text parts only: an image in a reply is nothing a VLM emits
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise RecordError(f"{key}.content", "a reply holds text parts only (images go in the prompt)")
        content = "".join(p.get("text", "") for p in content)
    if not isinstance(content, str) or not content:
        raise RecordError(f"{key}.content", "expected non-empty text")
    return content


def read_vision_sft_data(config: SFTDataConfig, rejects_dir: str | Path | None = None) -> VisionData[VisionSample]:
    """The train and held-out image chats of an SFT recipe's `data` section (see the module docstring)."""
    def read(source: DataSource, base_dir: Path | None, default_source: str, record: Any) -> VisionSample:
        return validate_vision_record(_renamed(record, source), base_dir=base_dir, default_source=default_source)

    return _read(config, rejects_dir, read, lambda s: vision_prompt_key(s.prompt_messages, s.images),
                 lambda s: vision_prompt_key(s.messages, s.images) + json.dumps(s.messages), "samples",
                 dedup=config.dedup.exact)


def read_vision_pair_data(config: PreferenceDataConfig, rejects_dir: str | Path | None = None
                          ) -> VisionData[VisionPairSample]:
    """The train and held-out image preference pairs of a DPO recipe's `data` section."""
    def read(source: DataSource, base_dir: Path | None, default_source: str, record: Any) -> VisionPairSample:
        return validate_vision_pair(_renamed(record, source), base_dir=base_dir, default_source=default_source)

    return _read(config, rejects_dir, read, lambda p: vision_prompt_key(p.prompt, p.images), None, "pairs",
                 dedup=False)


def _renamed(record: Any, source: DataSource) -> Any:
    renames = {v: k for k, v in source.columns.items()}
    return {renames.get(k, k): v for k, v in record.items()} if isinstance(record, dict) else record


def _read(config: Any, rejects_dir: str | Path | None, read: Callable[..., Any], prompt_key: Callable[[Any], str],
          whole_key: Callable[[Any], str] | None, what: str, *, dedup: bool) -> VisionData:
    if not config.train:
        raise DataError("data.train: no training data (add a source: data.train: [{path: train.jsonl}])")
    if config.on_invalid == "skip" and rejects_dir is None:
        raise DataError("data.on_invalid: skip needs a rejects_dir to write the rejected records to")
    rejects = RejectLog(Path(rejects_dir) / REJECTS_FILE, append=False) if config.on_invalid == "skip" else None
    try:
        train = [item for source in config.train for item in _read_source(source, config.on_invalid, rejects, read)]
        given = [item for source in config.heldout for item in _read_source(source, config.on_invalid, rejects, read)]
    finally:
        if rejects is not None:
            rejects.close()
    duplicates = 0
    if dedup and whole_key is not None:
        seen: set[str] = set()
        kept = []
        for item in train:
            key = whole_key(item)
            if key not in seen:
                seen.add(key)
                kept.append(item)
        duplicates, train = len(train) - len(kept), kept
    overlap = 0
    if given:
        heldout_keys = {prompt_key(item) for item in given}
        kept = [item for item in train if prompt_key(item) not in heldout_keys]
        overlap, train, heldout = len(train) - len(kept), kept, given
    else:
        fraction = config.heldout_fraction
        heldout = [item for item in train if fraction > 0 and prompt_fraction(prompt_key(item)) < fraction]
        train = [item for item in train if not (fraction > 0 and prompt_fraction(prompt_key(item)) < fraction)]
    if not train:
        raise DataError(f"data.train: no valid training {what}" + (" (all were rejected)"
                                                                  if rejects and rejects.count else ""))
    report = {what: {"train": len(train), "heldout": len(heldout)}, "rejected": rejects.count if rejects else 0,
              "duplicates_dropped": duplicates, "train_sharing_heldout_prompt": overlap,
              "images": sum(len(item.images) for item in train + heldout)}
    return VisionData(train, heldout, report)


def _read_source(source: DataSource, on_invalid: str, rejects: RejectLog | None, read: Callable[..., Any]) -> list:
    base_dir = resolve_path(source.path).parent if source.path is not None else None
    default_source = source.source or (Path(source.path).name if source.path is not None else source.hf)
    items = []
    for location, record in read_records(source, on_invalid=on_invalid, rejects=rejects):  # type: ignore[arg-type]
        try:
            item = read(source, base_dir, default_source, record)
        except RecordError as error:
            if on_invalid != "skip" or rejects is None:
                raise DataError(f"{where(source.name, location)}: {error}") from None
            rejects.add(source.name, location, str(error), _printable(record))
            continue
        item.metadata.origin = where(source.name, location)
        items.append(item)
    return items


def vision_texts(items: Sequence[VisionSample | VisionPairSample]) -> list[str]:
    """Every text of the chats or pairs (what the built-in tokenizer is trained on)."""
    texts: list[str] = []
    for item in items:
        messages = item.messages if isinstance(item, VisionSample) else item.prompt
        texts += [part["text"] for m in messages for part in m["content"] if part.get("type") == "text"]
        if isinstance(item, VisionPairSample):
            texts += [item.chosen, item.rejected]
    return texts
