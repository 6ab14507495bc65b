"""Format checks (a regex or a small grammar) and combined rewards whose parts are reported separately.

`verify_format` scores 1 when the completion matches - the whole of it by default. `combine` weights several
rewards into one (``score = sum(w * s) / sum(w)``), keeps each part's score in ``components`` and its details
under its name, and passes only when every part passes. The registered ``"combined"`` verifier does the same
from a task spec:

    Task(..., verifier="combined", verifier_args={"components": {
        "correct": {"verifier": "math", "args": {"reference": "42"}, "weight": 0.9},
        "format": {"verifier": "format", "args": {"pattern": r"(?s)<think>.*</think>.*\\\\boxed\\{.*\\}"},
                   "weight": 0.1}}})

If any part is an infrastructure failure the combined reward is that failure (retry the whole judgement).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from posttrain.types import FailureClass, Reward
from posttrain.verify.errors import VerifyError
from posttrain.verify.grammar import Grammar
from posttrain.verify.registry import check_verifier_args, get_verifier, verifier

try:  # the `regex` package (a transformers dependency) can stop a runaway match; `re` cannot
    import regex as _regex
except ImportError:  # pragma: no cover - exercised only without transformers
    _regex = None

_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}
_REGEX_TIMEOUT_S = 1.0


def _compile(pattern: str, flags: str) -> Any:
    bits = 0
    for flag in flags:
        if flag not in _FLAGS:
            raise VerifyError(f"verifier 'format': unknown regex flag {flag!r}; known: {''.join(_FLAGS)}")
        bits |= _FLAGS[flag]
    try:
        return (_regex or re).compile(pattern, bits)
    except (re.error, getattr(_regex, "error", re.error)) as error:
        raise VerifyError(f"verifier 'format': bad pattern {pattern!r}: {error}") from None


def _check_format_args(pattern: Any = None, grammar: Any = None, flags: str = "", **_: Any) -> None:
    if (pattern is None) == (grammar is None):
        raise VerifyError("verifier 'format': give exactly one of pattern (a regex) or grammar")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise VerifyError("verifier 'format': pattern must be a string")
        _compile(pattern, flags)
    else:
        if not isinstance(grammar, str):
            raise VerifyError("verifier 'format': grammar must be a string of `name ::= expression` rules")
        Grammar(grammar)


@verifier("format", check=_check_format_args, blocking=False)
def verify_format(completion: str, pattern: str | None = None, *, grammar: str | None = None, flags: str = "",
                  full_match: bool = True, final_state: dict[str, Any] | None = None) -> Reward:
    """1 if `completion` matches `pattern` (regex) or `grammar` (see `posttrain.verify.grammar`), else 0."""
    _check_format_args(pattern, grammar, flags)
    try:
        if pattern is not None:
            compiled = _compile(pattern, flags)
            method = compiled.fullmatch if full_match else compiled.search
            found = method(completion, timeout=_REGEX_TIMEOUT_S) if _regex else method(completion)
            ok = found is not None
        else:
            ok = Grammar(grammar).matches(completion)  # type: ignore[arg-type]
    except (TimeoutError, RecursionError):
        return Reward(0.0, False, FailureClass.FORMAT, details={"reason": "format_check_gave_up"})
    if ok:
        return Reward(1.0, True)
    return Reward(0.0, False, FailureClass.FORMAT, details={"reason": "format_mismatch"})


def combine(rewards: Mapping[str, Reward], weights: Mapping[str, float]) -> Reward:
    """One reward from named parts: weighted mean score, every part in ``components`` and ``details``."""
    if set(rewards) != set(weights):
        raise VerifyError(f"combine: weights {sorted(weights)} do not name the same parts as {sorted(rewards)}")
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise VerifyError("combine: weights must be non-negative with a positive sum")
    components = {name: reward.score for name, reward in rewards.items()}
    details = {name: reward.details for name, reward in rewards.items()}
    details["weights"] = dict(weights)
    broken = [r for r in rewards.values() if r.is_infrastructure_failure]
    if broken:
        return Reward(0.0, False, broken[0].failure, components=components, details=details)
    score = sum(weights[name] * reward.score for name, reward in rewards.items()) / sum(weights.values())
    failing = [rewards[name] for name in sorted(rewards, key=lambda n: -weights[n]) if not rewards[name].passed]
    if not failing:
        return Reward(score, True, FailureClass.NONE, components=components, details=details)
    return Reward(score, False, failing[0].failure, components=components, details=details)


def _check_combined_args(components: Any = None, **_: Any) -> None:
    if not isinstance(components, dict) or not components:
        raise VerifyError("verifier 'combined': components must be a non-empty dict of "
                          "name -> {verifier, args, weight}")
    for name, part in components.items():
        if not isinstance(part, dict) or "verifier" not in part:
            raise VerifyError(f"verifier 'combined': component {name!r} needs a 'verifier'")
        weight = part.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
            raise VerifyError(f"verifier 'combined': component {name!r} weight must be a non-negative number")
        if part["verifier"] == "combined":
            raise VerifyError("verifier 'combined': components cannot nest another 'combined'")
        check_verifier_args(part["verifier"], part.get("args", {}))


@verifier("combined", check=_check_combined_args)
def verify_combined(completion: str, components: dict[str, Any], *,
                    final_state: dict[str, Any] | None = None) -> Reward:
    """Run each component's verifier on the same completion and `combine` them with their weights."""
    _check_combined_args(components)
    rewards = {name: get_verifier(part["verifier"])(completion, final_state=final_state, **part.get("args", {}))
               for name, part in components.items()}
    return combine(rewards, {name: float(part.get("weight", 1.0)) for name, part in components.items()})
