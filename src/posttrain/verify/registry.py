"""The verifier registry and `verify`, the one call every room uses to judge a task's outcome.

A verifier is a function ``fn(text, *, final_state=None, **verifier_args) -> Reward`` registered under a name:

    @verifier("exact")
    def verify_exact(completion: str, answer: str, *, final_state=None) -> Reward: ...

`verify(task, completion_or_trajectory, final_state)` looks up ``task.verifier``, checks ``task.verifier_args``
against the function's signature, and calls it. The registered function is wrapped so that whatever it is
given (a string, bytes, a `Trajectory`, garbage) it returns a `Reward`: an unjudgeable completion scores 0 with
``FailureClass.FORMAT``, and an unexpected exception inside a verifier becomes ``FailureClass.INFRA`` (retried,
never a 0). Only a malformed spec raises: `VerifyError`, as early as `check_task` at task construction.

When the completion is empty and ``final_state["answer"]`` is a string (agentic episodes), that answer is judged.

A verifier registered with ``blocking=False`` promises to be pure Python that never waits (no sandbox, no worker
process, no I/O): an episode loop may then call it on its own thread instead of handing it to a worker thread
(`is_blocking`). A pure-Python verifier holds the GIL either way, so a worker thread would not keep the loop
responsive; it would only cost the hand-off.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from posttrain.types import FailureClass, Reward, Task
from posttrain.verify.completion import final_text, unjudgeable
from posttrain.verify.errors import VerifyError


class Verifier(Protocol):
    def __call__(self, completion: Any, *args: Any, final_state: dict[str, Any] | None = None,
                 **verifier_args: Any) -> Reward: ...


@dataclass(frozen=True)
class _Entry:
    name: str
    safe: Verifier  # the wrapped function: always returns a Reward for a well-formed spec
    raw: Callable[..., Reward]
    check: Callable[..., None] | None  # deeper spec validation than the signature (raises VerifyError)
    blocking: bool = True  # may wait (a sandbox, a worker process, I/O): callers run it in a worker thread


_REGISTRY: dict[str, _Entry] = {}


def _judged_text(completion: Any, final_state: dict[str, Any] | None) -> tuple[str, str | None]:
    text, problem = final_text(completion)
    if not problem and not text.strip() and isinstance(final_state, dict):
        answer = final_state.get("answer")
        if isinstance(answer, (str, bytes)):
            return final_text(answer)
    return text, problem


def register_verifier(name: str, fn: Callable[..., Reward], *, check: Callable[..., None] | None = None,
                      replace: bool = False, blocking: bool = True) -> Verifier:
    """Register `fn` under `name` and return its safe wrapper. `check(**verifier_args)` may raise VerifyError
    for a spec the signature alone cannot reject (malformed tests, an invalid schema ...). ``blocking=False``:
    `fn` never waits (see the module doc)."""
    if not name or not isinstance(name, str):
        raise VerifyError(f"a verifier name must be a non-empty string, got {name!r}")
    if name in _REGISTRY and not replace and _REGISTRY[name].raw is not fn:
        raise VerifyError(f"verifier {name!r} is already registered; pass replace=True to override it")

    @functools.wraps(fn)
    def safe(completion: Any, *args: Any, final_state: dict[str, Any] | None = None, **kwargs: Any) -> Reward:
        text, problem = _judged_text(completion, final_state)
        if problem:
            return unjudgeable(problem, verifier=name)
        try:
            reward = fn(text, *args, final_state=final_state, **kwargs)
        except VerifyError:
            raise
        except Exception as error:  # noqa: BLE001 - a verifier's bug is the system's failure, not the model's
            return Reward(score=0.0, passed=False, failure=FailureClass.INFRA,
                          details={"verifier": name, "error": f"{type(error).__name__}: {error}",
                                   "traceback": traceback.format_exc(limit=6)})
        reward.details.setdefault("verifier", name)
        return reward

    _REGISTRY[name] = _Entry(name, safe, fn, check, blocking)
    return safe


def verifier(name: str, *, check: Callable[..., None] | None = None,
             blocking: bool = True) -> Callable[[Callable[..., Reward]], Verifier]:
    """Decorator form of `register_verifier`: ``@verifier("math")``."""

    def register(fn: Callable[..., Reward]) -> Verifier:
        return register_verifier(name, fn, check=check, blocking=blocking)

    return register


def _entry(name: str) -> _Entry:
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise VerifyError(f"unknown verifier {name!r}; registered: {known}. Register your own with "
                          "@posttrain.verify.verifier(name)")
    return _REGISTRY[name]


def get_verifier(name: str) -> Verifier:
    """The registered verifier `name` (safe wrapper); VerifyError naming the registered ones if unknown."""
    return _entry(name).safe


def is_blocking(name: str) -> bool:
    """Whether verifier `name` may wait (run it in a worker thread); False only for ``blocking=False`` ones."""
    return _entry(name).blocking


def list_verifiers() -> list[str]:
    return sorted(_REGISTRY)


def check_verifier_args(name: str, verifier_args: dict[str, Any]) -> None:
    """Raise VerifyError unless `verifier_args` can be passed to verifier `name`."""
    entry = _entry(name)
    if not isinstance(verifier_args, dict):
        raise VerifyError(f"verifier_args for {name!r} must be a dict, got {type(verifier_args).__name__}")
    signature, takes, open_ended = _parameters(entry.raw)
    unknown = [key for key in verifier_args if key not in takes]
    if unknown and not open_ended:
        hints = [f"{key!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(key, takes, 1))
                 else repr(key) for key in unknown]
        raise VerifyError(f"verifier {name!r}: unknown argument {', '.join(hints)}; it takes: {', '.join(takes)}")
    try:
        signature.bind("", final_state=None, **verifier_args)
    except TypeError as error:
        raise VerifyError(f"verifier {name!r}: {error}; it takes: {', '.join(takes)}") from None
    if entry.check is not None:
        entry.check(**verifier_args)


@functools.lru_cache(maxsize=None)
def _parameters(fn: Callable[..., Reward]) -> tuple[inspect.Signature, tuple[str, ...], bool]:
    """`fn`'s signature, the verifier arguments it takes, and whether it takes any (``**kwargs``)."""
    signature = inspect.signature(fn)
    takes = tuple(p for p in list(signature.parameters)[1:] if p != "final_state")
    return signature, takes, any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())


def check_task(task: Task) -> None:
    """Validate a task's verifier spec at construction time (unknown name, bad arguments, malformed tests)."""
    try:
        check_verifier_args(task.verifier, task.verifier_args)
    except VerifyError as error:
        raise VerifyError(f"task {task.id!r}: {error}") from None


def verify(task: Task, completion: Any, final_state: dict[str, Any] | None = None) -> Reward:
    """Judge `completion` (text, bytes or a Trajectory) and `final_state` with the task's verifier."""
    entry = _entry(task.verifier)
    check_verifier_args(task.verifier, task.verifier_args)
    return entry.safe(completion, final_state=final_state, **task.verifier_args)
