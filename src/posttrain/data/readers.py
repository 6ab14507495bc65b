"""Readers: JSONL, Parquet, CSV, `datasets.save_to_disk` directories and `datasets.load_dataset` datasets,
with errors that name file, line and field.

Every reader yields raw records with their location, one at a time (a file is never read whole, so a source
larger than memory streams); `read_samples` converts them from their record format (`posttrain.data.formats`)
and validates them into `SFTSample`s, each carrying its origin (``train.jsonl:17``) in `metadata.origin`.
A location is a 1-based line number for JSONL and CSV (what an editor shows) and a 0-based row index for the
columnar formats (what `dataset[i]` takes); errors read ``train.jsonl:17: messages[1].role: ...`` and
``train.parquet:row 16: ...``. A line that is not UTF-8 is an invalid record like malformed JSON; a source
with no record at all is an error naming it.

An invalid record is an error by default. With ``on_invalid="skip"`` it is counted and appended to a rejects
file (one JSON object per reject: file, line or row, error, raw) through a `RejectLog`: never dropped silently.
Preference-pair readers reuse `read_records` / `read_jsonl_records` and validate their own schema on top.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

from posttrain.config import DataSource
from posttrain.data.formats import SourceFormat
from posttrain.data.schema import DataError, RecordError, SFTSample, validate_record

OnInvalid = Literal["error", "skip"]
Format = Literal["auto", "jsonl", "parquet", "csv", "hf_disk"]

_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_PARQUET_SUFFIXES = (".parquet", ".pq")
_CSV_SUFFIXES = (".csv",)
PACKAGE_PREFIX = "posttrain:"  # paths inside the installed package (the packaged recipes' data samples)
_PARQUET_BATCH_ROWS = 1024


class RejectLog:
    """Appends rejected records to a JSONL file (opened on the first reject) and counts them per file.

    With ``append=False`` an existing file is removed first, so the file holds this run's rejects only.
    With no path the rejects are only counted (for a pass that is not the one that reports them).
    `already_written`: the first that many rejects are only counted -- a streaming pass re-reads the same
    records in the same order, so the rejects an earlier pass wrote come first and are not written twice.
    """

    def __init__(self, path: str | Path | None, append: bool = True, already_written: int = 0):
        self.path = Path(path) if path is not None else None
        if self.path is not None and not append:
            self.path.unlink(missing_ok=True)
        self.counts: dict[str, int] = {}
        self.already_written = already_written
        self._handle = None

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    def add(self, file: str, location: str, error: str, raw: Any) -> None:
        self.counts[file] = self.counts.get(file, 0) + 1
        if self.path is None or self.count <= self.already_written:
            return
        if self._handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = self.path.open("a", encoding="utf-8")
        key, value = _split_location(location)
        entry = {"file": file, key: value, "error": error, "raw": raw}
        self._handle.write(json.dumps(entry, ensure_ascii=False, default=str) + "\n")
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> RejectLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split_location(location: str) -> tuple[str, int]:
    if location.startswith("row "):
        return "row", int(location[4:])
    return "line", int(location)


def resolve_format(path: str | Path, format: Format = "auto") -> Format:
    """The concrete format of `path`: a directory is a saved dataset, else the file extension decides."""
    if format != "auto":
        return format
    path = Path(path)
    if path.is_dir():
        return "hf_disk"
    name = path.name.lower()
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(_CSV_SUFFIXES):
        return "csv"
    raise DataError(
        f"{path}: cannot tell the format from the name; use .jsonl, .parquet or .csv, a directory written by "
        "datasets' save_to_disk, or set format: jsonl|parquet|csv|hf_disk"
    )


def resolve_path(path: str | Path) -> Path:
    """`path` itself, or for ``posttrain:recipes/data/x.jsonl`` the file inside the installed package."""
    text = str(path)
    if text.startswith(PACKAGE_PREFIX):
        return Path(__file__).resolve().parent.parent / text[len(PACKAGE_PREFIX):]
    return Path(path)


def read_records(
    path: str | Path | DataSource,
    format: Format = "auto",
    *,
    split: str | None = None,
    on_invalid: OnInvalid = "error",
    rejects: RejectLog | None = None,
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(location, record)`` for every object of a JSONL, Parquet, CSV or saved-dataset file, or of a
    `DataSource` (which may name an `hf` dataset; its own format and split are used then).

    `location` is the line number (JSONL, CSV) or ``"row i"``; format it with `where`. Malformed JSON, lines
    that are not UTF-8 and lines that are not objects are errors, or rejects when ``on_invalid="skip"``.
    A source without any record is an error naming it.
    """
    _check_on_invalid(on_invalid, rejects)
    if isinstance(path, DataSource):
        if path.hf is not None:
            yield from _nonempty(path.name, _hub_rows(path))
            return
        path, format, split = path.path, path.format, path.split  # type: ignore[assignment]
    path = resolve_path(path)  # type: ignore[arg-type]
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    kind = resolve_format(path, format)
    if kind == "jsonl":  # checks emptiness itself: a file whose every line was rejected is not empty
        for line_no, record in _jsonl_records(path, on_invalid, rejects):
            yield str(line_no), record
        return
    if kind == "csv":
        records = _csv_rows(path)
    else:
        rows = _parquet_rows(path) if kind == "parquet" else _dataset_rows(path, split)
        records = ((f"row {index}", _drop_arrow_nulls(row)) for index, row in enumerate(rows))
    yield from _nonempty(str(path), records)


def _nonempty(name: str, records: Iterable[tuple[str, dict[str, Any]]]) -> Iterator[tuple[str, dict[str, Any]]]:
    empty = True
    for item in records:
        empty = False
        yield item
    if empty:
        raise DataError(_empty(name))


def _empty(name: str) -> str:
    return f"{name}: empty (no records); remove it from the recipe or fill it"


def read_jsonl_records(
    path: str | Path, *, on_invalid: OnInvalid = "error", rejects: RejectLog | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_no, record)`` for each non-blank line of a JSONL file (line numbers are 1-based)."""
    _check_on_invalid(on_invalid, rejects)
    path = resolve_path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    yield from _jsonl_records(path, on_invalid, rejects)


_BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark


def _jsonl_records(
    path: Path, on_invalid: OnInvalid, rejects: RejectLog | None
) -> Iterator[tuple[int, dict[str, Any]]]:
    # Bytes, decoded line by line: one bad line is that line's error, not a traceback from the decoder.
    content = False
    with path.open("rb") as handle:
        for line_no, raw_line in enumerate(handle, start=1):
            if line_no == 1 and raw_line.startswith(_BOM):  # as Windows editors save UTF-8: a mark, not text
                raw_line = raw_line[len(_BOM):]
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as error:
                content = True
                problem = f"not valid UTF-8 (byte 0x{raw_line[error.start]:02x} at column {error.start + 1})"
                _invalid(path, str(line_no), problem, raw_line.decode("utf-8", "replace").rstrip("\n"),
                         on_invalid, rejects)
                continue
            if not line.strip():
                continue
            content = True
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                problem = f"malformed JSON: {error.msg} (column {error.colno})"
                _invalid(path, str(line_no), problem, line.rstrip("\n"), on_invalid, rejects)
                continue
            if not isinstance(record, dict):
                problem = f"expected a JSON object, got {type(record).__name__}"
                _invalid(path, str(line_no), problem, line.rstrip("\n"), on_invalid, rejects)
                continue
            yield line_no, record
    if not content:
        raise DataError(_empty(str(path)))


def read_samples(
    source: DataSource | str | Path,
    on_invalid: OnInvalid = "error",
    rejects_path: str | Path | RejectLog | None = None,
) -> list[SFTSample]:
    """Read and validate the SFT samples of one source (all of them; `iter_samples` streams).

    Records without ``metadata.source`` get ``source.source`` or, when unset, the file name.
    With ``on_invalid="skip"`` a `rejects_path` (or an open `RejectLog`) is required.
    """
    rejects = RejectLog(rejects_path) if isinstance(rejects_path, (str, Path)) else rejects_path
    try:
        return list(iter_samples(source, on_invalid, rejects))
    finally:
        if isinstance(rejects_path, (str, Path)) and rejects is not None:
            rejects.close()


def iter_samples(
    source: DataSource | str | Path, on_invalid: OnInvalid = "error", rejects: RejectLog | None = None
) -> Iterator[SFTSample]:
    """The SFT samples of one source, one at a time, each with ``metadata.origin`` = ``file:line``.

    Every record is converted from the source's record format (messages, ShareGPT, prompt/completion,
    Alpaca: detected on the first record unless `record_format` is set), through the source's `columns`
    and `metadata` mappings, then validated.
    """
    if not isinstance(source, DataSource):
        source = DataSource(path=str(source))
    _check_on_invalid(on_invalid, rejects)
    default_source = source.source or source_label(source)
    converter = SourceFormat(source.record_format, source.columns, source.metadata)
    for location, record in read_records(source, on_invalid=on_invalid, rejects=rejects):
        origin = where(source.name, location)
        try:
            sample = validate_record(converter.to_sft(record, origin), default_source)
        except RecordError as error:
            _invalid(source.name, location, str(error), record, on_invalid, rejects)
            continue
        sample.metadata.origin = origin
        yield sample


def source_label(source: DataSource) -> str:
    """The default `metadata.source`: the file name, or the dataset's name."""
    return Path(source.path).name if source.path is not None else source.hf  # type: ignore[return-value]


def where(path: str | Path, location: str | int) -> str:
    """``train.jsonl:17`` or ``train.parquet:row 16``: the prefix of every record error."""
    return f"{path}:{location}"


def _invalid(
    path: str | Path, location: str, problem: str, raw: Any, on_invalid: OnInvalid, rejects: RejectLog | None
) -> None:
    if on_invalid == "error" or rejects is None:
        raise DataError(f"{where(path, location)}: {problem}")
    rejects.add(str(path), location, problem, raw)


def _check_on_invalid(on_invalid: str, rejects: RejectLog | None) -> None:
    if on_invalid not in ("error", "skip"):
        raise DataError(f"on_invalid: expected 'error' or 'skip', got {on_invalid!r}")
    if on_invalid == "skip" and rejects is None:
        raise DataError("on_invalid='skip' needs a rejects file, so that no record is dropped silently")


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    # pyarrow directly (it is what `datasets` reads Parquet with): no cache files written beside the user's
    # data, and record batches, so a file larger than memory streams.
    import pyarrow.parquet

    try:
        batches = pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH_ROWS)
        for batch in batches:
            yield from batch.to_pylist()
    except Exception as error:  # pyarrow raises several unrelated types for unreadable files
        raise DataError(f"{path}: not a readable Parquet file ({error})") from error


def _csv_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """CSV rows as records of strings; the location is the row's first line (the header is line 1)."""
    try:
        # utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark that would otherwise join the first header
        with path.open(encoding="utf-8-sig", newline="") as handle:
            reader = csv.DictReader(handle)
            line = reader.line_num + 1
            for row in reader:
                if None in row:
                    raise DataError(f"{where(path, line)}: more cells than the header has columns")
                yield str(line), {key: value for key, value in row.items() if value is not None}
                line = reader.line_num + 1
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not valid UTF-8 (byte offset {error.start}); save the CSV as UTF-8") from None
    except csv.Error as error:
        raise DataError(f"{path}: not a readable CSV file ({error})") from None


def _dataset_rows(path: Path, split: str | None) -> Iterator[dict[str, Any]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:  # FileNotFoundError, ValueError ... depending on what is missing
        raise DataError(f"{path}: not a directory written by datasets' save_to_disk ({error})") from error
    # Arrow files are memory-mapped: iterating reads a row at a time, never the whole table into memory.
    yield from _pick_split(loaded, split, str(path))


def _hub_rows(source: DataSource) -> Iterator[tuple[str, dict[str, Any]]]:
    """Rows of `datasets.load_dataset(hf, subset, split=...)`: a hub id, a local dataset directory or script."""
    import datasets

    split = source.split or "train"
    try:
        loaded = datasets.load_dataset(source.hf, source.subset, split=split)
    except Exception as error:  # hub, network, script and split errors come in many types
        hint = ("" if Path(str(source.hf)).exists() else
                "; is the name right and the hub reachable (HF_HUB_OFFLINE unset)? A local copy: "
                "save_to_disk it and use path")
        raise DataError(f"{source.name}: datasets.load_dataset failed: {_one_line(error)}{hint}") from None
    for index, row in enumerate(loaded):
        yield f"row {index}", _drop_arrow_nulls(dict(row))


def _pick_split(loaded: Any, split: str | None, name: str) -> Any:
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded.keys())
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in loaded:
            wanted = "no split given" if split is None else f"no split {split!r}"
            raise DataError(f"{name}: {wanted}; set split to one of {', '.join(splits)}")
        loaded = loaded[split]
    return loaded


def _one_line(error: BaseException) -> str:
    """The error on one line, with its cause's (datasets wraps the useful message in a generic one)."""
    parts = []
    while error is not None and len(parts) < 2:
        lines = str(error).strip().splitlines()
        parts.append(f"{type(error).__name__}: {' '.join(line.strip() for line in lines)[:300]}")
        error = error.__cause__  # type: ignore[assignment]
    return " <- ".join(parts)


def _drop_arrow_nulls(row: dict[str, Any]) -> dict[str, Any]:
    """Arrow unifies struct fields across rows, so a message without `tool_calls` reads back with
    ``tool_calls: None``; drop such nulls in messages and metadata so the record means what was written."""
    messages = row.get("messages")
    if isinstance(messages, list):
        row["messages"] = [
            {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages
        ]
    metadata = row.get("metadata")
    if isinstance(metadata, dict):
        row["metadata"] = {k: v for k, v in metadata.items() if v is not None}
    return row
