"""Structured extraction: JSON parse, JSON-Schema validation, each field right and grounded in the source.

Score = the fraction of reference fields whose value equals the reference after normalization *and* (when a
``source`` text is given) appears in the source after the same normalization - a value the model made up
scores nothing even when the schema accepts it. Output that does not parse, is not exactly one JSON value, or
fails the schema scores 0 (``FailureClass.FORMAT``). Nested objects are compared field by field (dotted paths);
lists element by element. Normalization: Unicode NFKC, case-folded, whitespace collapsed, surrounding
punctuation dropped; numbers compare by value, and ground in the source with or without thousands separators.
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any

import jsonschema

from posttrain.types import FailureClass, Reward
from posttrain.verify.completion import code_block, strip_reasoning
from posttrain.verify.errors import VerifyError
from posttrain.verify.registry import verifier

_SPACE = re.compile(r"\s+")
_EDGE_PUNCT = re.compile(r"^[\s\"'`.,;:!?()\[\]{}]+|[\s\"'`.,;:!?()\[\]{}]+$")


def normalize_text(value: Any) -> str:
    text = unicodedata.normalize("NFKC", str(value)).casefold()
    return _EDGE_PUNCT.sub("", _SPACE.sub(" ", text)).strip()


def _number_forms(value: float | int) -> set[str]:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    forms = {str(value)}
    if isinstance(value, int):
        forms.add(f"{value:,}")
    else:
        forms.add(f"{value:,.2f}")
        forms.add(f"{value:.2f}")
    return forms


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}{key}." if isinstance(item, dict) else f"{prefix}{key}"))
        return flat
    return {prefix.rstrip("."): value}


def _equal(got: Any, expected: Any) -> bool:
    if isinstance(expected, bool) or isinstance(got, bool):
        return got is expected
    if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
        return float(got) == float(expected)
    if isinstance(expected, list):
        return isinstance(got, list) and len(got) == len(expected) and all(map(_equal, got, expected))
    if expected is None or got is None:
        return got is expected
    return isinstance(got, str) and normalize_text(got) == normalize_text(expected)


def _grounded(value: Any, source_norm: str) -> bool:
    if isinstance(value, list):
        return all(_grounded(item, source_norm) for item in value)
    if value is None or isinstance(value, bool):
        return True  # nothing to find in the text
    if isinstance(value, (int, float)):
        return any(normalize_text(form) in source_norm for form in _number_forms(value))
    return normalize_text(value) in source_norm


def extract_json(text: str) -> tuple[Any, str | None]:
    """(value, None), or (None, reason): the last ```json block, else the whole text, else the one object in it."""
    body = strip_reasoning(text).strip()
    block = code_block(body, languages=("json", ""))
    candidates = [block] if block is not None else [body]
    if block is None and "{" in body:
        candidates.append(body[body.index("{"):body.rindex("}") + 1] if "}" in body else "")
    for candidate in candidates:
        try:
            return json.loads(candidate), None
        except (ValueError, RecursionError):
            continue
    return None, "invalid_json"


def _check_structured_args(schema: Any = None, reference: Any = None, source: Any = None, **_: Any) -> None:
    if not isinstance(schema, dict):
        raise VerifyError(f"verifier 'structured': schema must be a JSON-Schema object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        raise VerifyError(f"verifier 'structured': invalid JSON schema: {error.message}") from None
    if not isinstance(reference, dict) or not reference:
        raise VerifyError("verifier 'structured': reference must be a non-empty dict of field -> expected value")
    if source is not None and not isinstance(source, str):
        raise VerifyError("verifier 'structured': source must be the text the fields are extracted from")


@verifier("structured", check=_check_structured_args, blocking=False)
def verify_structured(completion: str, schema: dict[str, Any], reference: dict[str, Any], source: str | None = None,
                      *, ground: bool = True, final_state: dict[str, Any] | None = None) -> Reward:
    """Fraction of `reference` fields right (and grounded in `source`); 0 unless valid against `schema`."""
    _check_structured_args(schema, reference, source)
    value, problem = extract_json(completion)
    if problem:
        return Reward(0.0, False, FailureClass.FORMAT, details={"reason": problem})
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(value), key=lambda e: list(e.path))
    if errors:
        return Reward(0.0, False, FailureClass.FORMAT,
                      details={"reason": "schema_invalid", "errors": [e.message[:200] for e in errors[:5]]})
    expected = _flatten(reference)
    got = _flatten(value) if isinstance(value, dict) else {}
    source_norm = normalize_text(source) if (source is not None and ground) else None
    fields: dict[str, str] = {}
    for path, want in expected.items():
        if path not in got:
            fields[path] = "missing"
        elif not _equal(got[path], want):
            fields[path] = "wrong"
        elif source_norm is not None and not _grounded(got[path], source_norm):
            fields[path] = "not_grounded"
        else:
            fields[path] = "right"
    right = sum(v == "right" for v in fields.values())
    score = right / len(expected)
    details = {"fields": fields, "right": right, "total": len(expected)}
    if right == len(expected):
        return Reward(1.0, True, details=details)
    return Reward(score, False, FailureClass.WRONG_ANSWER, details=details)
