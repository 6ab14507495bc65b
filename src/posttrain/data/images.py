"""Chat samples with images: image parts of a message parsed, loaded with Pillow and checked.

A record is an OpenAI-style chat whose message content may be a list of parts:

    {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "shapes/0001.png"}},      # a file, relative to the data file
        {"type": "text", "text": "How many shapes are there?"}]},
     {"role": "assistant", "content": "3"}],
     "metadata": {"domain": "image_count"}}

An image part is one of
- ``{"type": "image_url", "image_url": {"url": U}}`` (or ``"image_url": U``), U a local path, a ``file://`` path or
  a ``data:image/...;base64,...`` URL;
- ``{"type": "image", "image": X}`` (also ``"url"`` or ``"path"`` in place of ``"image"``), X any of the above, raw
  bytes, a PIL image or a datasets ``Image`` value (``{"bytes": ..., "path": ...}``);
- ``{"type": "image"}`` alone: the next image of the record's ``images`` column (or its single ``image``), which
  is how datasets with an ``Image`` column (TRL's vision format) store them; the parts and the column must agree
  in number.

Remote URLs (``http://``, ``https://``) are not fetched: download the images and point at the files. Every image
is decoded in full when the record is read (a truncated or corrupt file fails there, not mid-training), must be a
format in `IMAGE_FORMATS`, and is converted to RGB. Images may appear in system and user turns, not in assistant
turns (nothing here trains a model to emit images). A bad image is a one-line error naming the record and the
part: ``train.jsonl:4: messages[0].content[0]: no such image file 'shapes/0009.png'``.

A `VisionSample` holds messages whose content is a list of ``{"type": "text", "text"}`` and ``{"type": "image"}``
parts (what processors' chat templates expect) and the images in order of appearance.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from posttrain.chat import IMAGE_PART_TYPES
from posttrain.config import DataSource
from posttrain.data.readers import OnInvalid, RejectLog, read_records, resolve_path, where
from posttrain.data.schema import (
    DataError,
    RecordError,
    SampleMetadata,
    _validate_metadata,
    message_role,
    require_prompt_first,
)
from posttrain.types import Message

if TYPE_CHECKING:
    from PIL import Image

VISION_HINT = "pip install 'posttrain[vision]' (or: pip install pillow)"
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")
_MAX_PIXELS = 40_000_000  # one image above this is refused (a decompression bomb, or not meant for a VLM)


@dataclass
class VisionSample:
    """A chat with images: `messages` hold text and ``{"type": "image"}`` parts, `images` the decoded images."""

    messages: list[Message]
    images: list[Image.Image] = field(default_factory=list)  # PIL images, RGB
    metadata: SampleMetadata = field(default_factory=SampleMetadata)

    @property
    def prompt_messages(self) -> list[Message]:
        """The turns before the first assistant turn."""
        for index, message in enumerate(self.messages):
            if message["role"] == "assistant":
                return self.messages[:index]
        return list(self.messages)


def pillow() -> Any:
    """The PIL.Image module, or a `DataError` saying how to install Pillow (images are an optional extra)."""
    try:
        from PIL import Image
    except ImportError:
        raise DataError(f"reading images needs Pillow: {VISION_HINT}") from None
    return Image


def load_image(value: Any, base_dir: str | Path | None = None) -> Image.Image:
    """An RGB PIL image from a path, ``file://`` or ``data:`` URL, bytes, a datasets Image value or a PIL image.

    Raises `ValueError` with a one-line reason (the caller adds the record and the part).
    """
    Image = pillow()
    if isinstance(value, Image.Image):
        return _checked(value, "the image")
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # datasets' Image storage
        if value.get("bytes") is not None:
            return _decoded_bytes(value["bytes"], "the image bytes")
        value = value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _decoded_bytes(bytes(value), "the image bytes")
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected an image path, URL, bytes or PIL image, got {type(value).__name__}")
    if value.startswith("data:"):
        return _decoded_bytes(_data_url_bytes(value), "the data: URL")
    if value.startswith(("http://", "https://")):
        raise ValueError(f"remote image URLs are not fetched ({value[:80]}); download the image and give its path")
    path = Path(value[len("file://"):] if value.startswith("file://") else value)
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        raise ValueError(f"no such image file '{value}'")
    return _decoded_bytes(path.read_bytes(), f"'{value}'")


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:image/") or not header.endswith(";base64"):
        raise ValueError("a data: URL must read data:image/<format>;base64,<payload>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the data: URL's payload is not valid base64") from None


def _decoded_bytes(data: bytes, what: str) -> Image.Image:
    Image = pillow()
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as error:
        raise ValueError(f"{what}: {error}") from None
    except (Image.UnidentifiedImageError, OSError, ValueError):
        raise ValueError(f"{what} is not an image Pillow can read (corrupt, or an unsupported format)") from None
    return _checked(image, what)


def _checked(image: Image.Image, what: str) -> Image.Image:
    if image.format is not None and image.format not in IMAGE_FORMATS:
        raise ValueError(f"{what}: unsupported image format {image.format} (supported: {', '.join(IMAGE_FORMATS)})")
    if image.width * image.height > _MAX_PIXELS:
        raise ValueError(f"{what}: {image.width}x{image.height} pixels is over the {_MAX_PIXELS:,}-pixel limit")
    try:
        image.load()  # decode now: a truncated file fails here, with its record named
    except (OSError, SyntaxError, ValueError) as error:
        raise ValueError(f"{what} is corrupt or truncated ({error})") from None
    return image if image.mode == "RGB" else image.convert("RGB")


def validate_vision_record(record: Any, *, base_dir: str | Path | None = None, default_source: str | None = None,
                           require_assistant: bool = True) -> VisionSample:
    """Check one raw chat record with image parts and load its images; raise `RecordError` naming the field."""
    if not isinstance(record, dict):
        raise RecordError("<record>", f"expected an object, got {type(record).__name__}")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RecordError("messages", "expected a non-empty list of {role, content} objects")
    column = _image_column(record)
    images: list[Image.Image] = []
    clean = [_message(m, f"messages[{i}]", column, images, base_dir) for i, m in enumerate(messages)]
    if column and len(column) > 0:
        raise RecordError("images", f"{len(column)} image(s) of the column are not referred to by an "
                          "{type: image} part")
    if require_assistant:
        if not any(m["role"] == "assistant" for m in clean):
            raise RecordError("messages", "no assistant turn (nothing to train on)")
        require_prompt_first(clean)
    meta = record.get("metadata", {}) or {}
    if not isinstance(meta, dict):
        raise RecordError("metadata", f"expected an object, got {type(meta).__name__}")
    return VisionSample(messages=clean, images=images, metadata=_validate_metadata(meta, default_source))


def _image_column(record: dict[str, Any]) -> list[Any] | None:
    if record.get("images") is not None:
        column = record["images"]
        if not isinstance(column, list):
            raise RecordError("images", f"expected a list of images, got {type(column).__name__}")
        return list(column)
    if record.get("image") is not None:
        return [record["image"]]
    return None


def _message(message: Any, where_: str, column: list[Any] | None, images: list[Image.Image],
             base_dir: str | Path | None) -> Message:
    role = message_role(message, where_)
    content = message.get("content")
    if isinstance(content, str):
        return {"role": role, "content": [{"type": "text", "text": content}]}
    if not isinstance(content, list) or not content:
        raise RecordError(f"{where_}.content", "expected a string or a non-empty list of parts")
    parts = []
    for j, part in enumerate(content):
        here = f"{where_}.content[{j}]"
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict):
            raise RecordError(here, f"expected a part object, got {type(part).__name__}")
        part = {k: v for k, v in part.items() if v is not None}  # Arrow fills absent struct fields with nulls
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in IMAGE_PART_TYPES:
            if role == "assistant":
                raise RecordError(here, "an assistant turn cannot hold an image (images go in user or system turns)")
            images.append(_image_of_part(part, here, column, base_dir))
            parts.append({"type": "image"})
        else:
            raise RecordError(here, f"expected a text part or an image part ({', '.join(IMAGE_PART_TYPES)}), "
                              f"got type {kind!r}")
    return {"role": role, "content": parts}


def _image_of_part(part: dict[str, Any], here: str, column: list[Any] | None,
                   base_dir: str | Path | None) -> Image.Image:
    if part["type"] == "image_url":
        value = part.get("image_url")
        value = value.get("url") if isinstance(value, dict) else value
        if value is None:
            raise RecordError(here, "an image_url part needs image_url: {url: ...}")
    else:
        value = next((part[key] for key in ("image", "url", "path") if key in part), None)
        if value is None:
            if not column:
                raise RecordError(here, "an {type: image} part without data needs a next image in the record's "
                                  "images column, and there is none left")
            value = column.pop(0)
    try:
        return load_image(value, base_dir)
    except ValueError as error:
        raise RecordError(here, str(error)) from None


def iter_vision_samples(source: DataSource | str | Path, on_invalid: OnInvalid = "error",
                        rejects: RejectLog | None = None) -> Iterator[VisionSample]:
    """The vision samples of one JSONL, Parquet or saved-dataset source, each with ``metadata.origin``.

    Relative image paths are resolved against the data file's directory. Only the ``messages`` record format
    is read here (with the source's `columns` renames applied).
    """
    if not isinstance(source, DataSource):
        source = DataSource(path=str(source))
    if on_invalid == "skip" and rejects is None:
        raise DataError("on_invalid='skip' needs a rejects file, so that no record is dropped silently")
    base_dir = resolve_path(source.path).parent if source.path is not None else None
    default_source = source.source or (Path(source.path).name if source.path is not None else source.hf)
    renames = {v: k for k, v in source.columns.items()}
    for location, record in read_records(source, on_invalid=on_invalid, rejects=rejects):
        record = {renames.get(k, k): v for k, v in record.items()}
        try:
            sample = validate_vision_record(record, base_dir=base_dir, default_source=default_source)
        except RecordError as error:
            if on_invalid == "error" or rejects is None:
                raise DataError(f"{where(source.name, location)}: {error}") from None
            rejects.add(source.name, location, str(error), _printable(record))
            continue
        sample.metadata.origin = where(source.name, location)
        yield sample


def read_vision_samples(source: DataSource | str | Path, on_invalid: OnInvalid = "error",
                        rejects: RejectLog | None = None) -> list[VisionSample]:
    """Every vision sample of one source (`iter_vision_samples`, read whole)."""
    return list(iter_vision_samples(source, on_invalid, rejects))


def _printable(record: dict[str, Any]) -> dict[str, Any]:
    """The record for the rejects file: images (bytes, PIL) replaced by a short description."""
    Image = pillow()

    def describe(value: Any) -> Any:
        if isinstance(value, Image.Image):
            return f"<PIL image {value.width}x{value.height}>"
        if isinstance(value, (bytes, bytearray, memoryview)):
            return f"<{len(value)} bytes>"
        if isinstance(value, dict):
            return {k: describe(v) for k, v in value.items()}
        if isinstance(value, list):
            return [describe(v) for v in value]
        return value
    return describe(record)
