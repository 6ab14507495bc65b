"""Readers: JSONL, Parquet and `datasets.save_to_disk` directories, with errors that name file, line and field.

Every reader yields raw records with their location; `read_samples` validates them into `SFTSample`s.
A location is a 1-based line number for JSONL (what an editor shows) and a 0-based row index for the
columnar formats (what `dataset[i]` takes); errors read ``train.jsonl:17: messages[1].role: ...`` and
``train.parquet:row 16: ...``.

An invalid record is an error by default. With ``on_invalid="skip"`` it is counted and appended to a rejects
file (one JSON object per reject: file, line or row, error, raw) through a `RejectLog`: never dropped silently.
Preference-pair readers reuse `read_records` / `read_jsonl_records` and validate their own schema on top.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Literal

from posttrain.config import DataSource
from posttrain.data.schema import DataError, RecordError, SFTSample, validate_record

OnInvalid = Literal["error", "skip"]
Format = Literal["auto", "jsonl", "parquet", "hf_disk"]

_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_PARQUET_SUFFIXES = (".parquet", ".pq")


class RejectLog:
    """Appends rejected records to a JSONL file (opened on the first reject) and counts them per file.

    With ``append=False`` an existing file is removed first, so the file holds this run's rejects only.
    With no path the rejects are only counted (for a pass that is not the one that reports them).
    """

    def __init__(self, path: str | Path | None, append: bool = True):
        self.path = Path(path) if path is not None else None
        if self.path is not None and not append:
            self.path.unlink(missing_ok=True)
        self.counts: dict[str, int] = {}
        self._handle = None

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    def add(self, file: str, location: str, error: str, raw: Any) -> None:
        self.counts[file] = self.counts.get(file, 0) + 1
        if self.path is None:
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
    raise DataError(
        f"{path}: cannot tell the format from the name; use .jsonl or .parquet, a directory written by "
        "datasets' save_to_disk, or set format: jsonl|parquet|hf_disk"
    )


def read_records(
    path: str | Path,
    format: Format = "auto",
    *,
    split: str | None = None,
    on_invalid: OnInvalid = "error",
    rejects: RejectLog | None = None,
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(location, record)`` for every object in a JSONL, Parquet or saved-dataset source.

    `location` is the line number (JSONL) or ``"row i"``; format it with `where`. Malformed JSON and lines that
    are not objects are errors, or rejects when ``on_invalid="skip"``.
    """
    _check_on_invalid(on_invalid, rejects)
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    kind = resolve_format(path, format)
    if kind == "jsonl":
        for line_no, record in read_jsonl_records(path, on_invalid=on_invalid, rejects=rejects):
            yield str(line_no), record
        return
    rows = _parquet_rows(path) if kind == "parquet" else _dataset_rows(path, split)
    for index, row in enumerate(rows):
        yield f"row {index}", _drop_arrow_nulls(row)


def read_jsonl_records(
    path: str | Path, *, on_invalid: OnInvalid = "error", rejects: RejectLog | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_no, record)`` for each non-blank line of a JSONL file (line numbers are 1-based)."""
    _check_on_invalid(on_invalid, rejects)
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
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


def read_samples(
    source: DataSource | str | Path,
    on_invalid: OnInvalid = "error",
    rejects_path: str | Path | RejectLog | None = None,
) -> list[SFTSample]:
    """Read and validate the SFT samples of one source.

    Records without ``metadata.source`` get ``source.source`` or, when unset, the file name.
    With ``on_invalid="skip"`` a `rejects_path` (or an open `RejectLog`) is required.
    """
    if not isinstance(source, DataSource):
        source = DataSource(path=str(source))
    rejects = RejectLog(rejects_path) if isinstance(rejects_path, (str, Path)) else rejects_path
    _check_on_invalid(on_invalid, rejects)
    default_source = source.source or Path(source.path).name
    samples = []
    try:
        records = read_records(source.path, source.format, split=source.split, on_invalid=on_invalid, rejects=rejects)
        for location, record in records:
            try:
                samples.append(validate_record(record, default_source))
            except RecordError as error:
                _invalid(Path(source.path), location, str(error), record, on_invalid, rejects)
    finally:
        if isinstance(rejects_path, (str, Path)) and rejects is not None:
            rejects.close()
    return samples


def where(path: str | Path, location: str | int) -> str:
    """``train.jsonl:17`` or ``train.parquet:row 16``: the prefix of every record error."""
    return f"{path}:{location}"


def _invalid(
    path: Path, location: str, problem: str, raw: Any, on_invalid: OnInvalid, rejects: RejectLog | None
) -> None:
    if on_invalid == "error" or rejects is None:
        raise DataError(f"{where(path, location)}: {problem}")
    rejects.add(str(path), location, problem, raw)


def _check_on_invalid(on_invalid: str, rejects: RejectLog | None) -> None:
    if on_invalid not in ("error", "skip"):
        raise DataError(f"on_invalid: expected 'error' or 'skip', got {on_invalid!r}")
    if on_invalid == "skip" and rejects is None:
        raise DataError("on_invalid='skip' needs a rejects file, so that no record is dropped silently")


def _parquet_rows(path: Path) -> list[dict[str, Any]]:
    # pyarrow directly (it is what `datasets` reads Parquet with): no cache files written beside the user's data.
    import pyarrow.parquet

    try:
        return pyarrow.parquet.read_table(path).to_pylist()
    except Exception as error:  # pyarrow raises several unrelated types for unreadable files
        raise DataError(f"{path}: not a readable Parquet file ({error})") from error


def _dataset_rows(path: Path, split: str | None) -> list[dict[str, Any]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:  # FileNotFoundError, ValueError ... depending on what is missing
        raise DataError(f"{path}: not a directory written by datasets' save_to_disk ({error})") from error
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded.keys())
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in loaded:
            wanted = "no split given" if split is None else f"no split {split!r}"
            raise DataError(f"{path}: {wanted}; set split to one of {', '.join(splits)}")
        loaded = loaded[split]
    return loaded.to_list()


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
