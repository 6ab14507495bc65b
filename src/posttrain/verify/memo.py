"""Identical judgements, judged once.

An RL group's samples are often one program written several times: in the demo's 90 RL steps, 16,744 code
judgements held 4,330 distinct (task, program) pairs per step, so three jails in four judged a program the same
step had judged already. A sandboxed verdict is a function of what enters the jail (program, test inputs,
workspace), the limits and jail it runs under, and how it is compared afterwards, so a verifier hashes exactly
that into a key and runs one judgement per key: callers that arrive while it runs wait for its verdict, later
ones read it from a bounded cache. Each caller gets its own copy of the `Reward`, the copies marked
``"reused": true`` in details. A verdict the memo must not hand on is the judgement's own infrastructure failure:
it is never kept, and a caller that waited on one runs its own judgement. Where a verdict is not a function of
those inputs (tests that draw random inputs inside the jail) the verifier's ``reuse: false`` judges every call.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import threading
import weakref
from typing import Any, Callable

from posttrain.types import Reward

MEMO_SIZE = 4096  # verdicts kept per pool (least recently used first out): a few steps' distinct programs


def judgement_key(*parts: Any) -> str:
    """A digest of everything a verdict depends on (JSON-able values; bytes hashed as they are)."""
    digest = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else json.dumps(part, sort_keys=True, default=repr).encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


class JudgementMemo:
    """Verdicts by key: one judgement per key at a time, the last `size` verdicts kept. Thread-safe (blocking
    verifiers run on asyncio's thread pool)."""

    def __init__(self, size: int = MEMO_SIZE):
        self.size = size
        self._kept: collections.OrderedDict[str, Reward] = collections.OrderedDict()
        self._running: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def judge(self, key: str, judge: Callable[[], Reward]) -> Reward:
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                return _copy(kept, reused=True)
            waiting = self._running.get(key)
            if waiting is None:
                running = self._running[key] = concurrent.futures.Future()
        if waiting is not None:
            try:
                verdict = waiting.result()
            except BaseException:  # noqa: BLE001 - that caller's own error; this one judges for itself
                return judge()
            return judge() if verdict.is_infrastructure_failure else _copy(verdict, reused=True)
        try:
            verdict = judge()
        except BaseException as error:
            with self._lock:
                del self._running[key]
            running.set_exception(error)
            raise
        with self._lock:
            del self._running[key]
            if not verdict.is_infrastructure_failure:
                self._kept[key] = verdict
                while len(self._kept) > self.size:
                    self._kept.popitem(last=False)
        running.set_result(verdict)
        return _copy(verdict, reused=False)


def _copy(verdict: Reward, *, reused: bool) -> Reward:
    """A caller's own Reward (callers add to details: one must not write into another's)."""
    details = {**verdict.details, **({"reused": True} if reused else {})}
    return dataclasses.replace(verdict, components=dict(verdict.components), details=details)


def judged_once(box: Any, reuse: bool, judge: Callable[[], Reward], *parts: Any) -> Reward:
    """`judge()`, run once per key in the memo of the sandbox `box`'s pool: the key is `parts` (everything of the
    run the verdict depends on) with the jail `box` shows and its class, which may run the jail its own way (a
    wrapper around the same pool; the class object, not its name: two wrappers made by one factory share a
    name). Judged every call without `reuse` or where `box` has no pool to keep verdicts for."""
    memo = _pool_memo(box) if reuse else None
    if memo is None:
        return judge()
    kind = type(box)
    return memo.judge(judgement_key(*parts, repr(getattr(box, "jail", None)),
                                    f"{kind.__module__}.{kind.__qualname__}@{id(kind)}"), judge)


# Each sandbox pool's verdicts: another pool may run another jail, so none is shared.
_pool_memos: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_pool_memos_lock = threading.Lock()


def _pool_memo(box: Any) -> JudgementMemo | None:
    """The memo of the sandbox `box`'s pool; None for a sandbox without one (nothing to tell its jails apart by)."""
    pool = getattr(box, "pool", None)
    if pool is None:
        return None
    with _pool_memos_lock:
        try:
            memo = _pool_memos.get(pool)
            if memo is None:
                memo = _pool_memos[pool] = JudgementMemo()
        except TypeError:  # a pool that cannot be weakly referenced: judged every time
            return None
    return memo
