"""A small pool of math-verify worker processes with an external timeout per comparison.

`check(reference, answer, rational, timeout_s)` returns "equal", "different" (math-verify could not parse the
answer counts as different), "timeout", or "infra" (no worker could run the comparison); `check_pairs` runs
several comparisons in one request under one timeout and returns a list of booleans (or "timeout"/"infra"). A
worker that does not answer in time is killed (SIGKILL) and replaced on next use, so an adversarial answer costs at
most `timeout_s` and never a hung thread. Workers start on first use (importing sympy takes about a second,
outside the timeout) and are shared by every thread of the process.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import select
import subprocess
import sys
import threading

_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_math_server.py")
_START_TIMEOUT_S = 60.0


class _Worker:
    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True,
        )
        self.ready = False

    def _read_line(self, timeout_s: float) -> dict | None:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = self.process.stdout.readline()
        return json.loads(line) if line else None

    def ask(self, request: dict, timeout_s: float) -> dict | None:
        if not self.ready:
            hello = self._read_line(_START_TIMEOUT_S)
            if not hello or not hello.get("ready"):
                raise RuntimeError("math-verify worker did not start (is math-verify installed?)")
            self.ready = True
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        return self._read_line(timeout_s)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


class MathWorkers:
    def __init__(self, size: int = 2):
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(size):
            self._idle.put(None)  # started lazily
        self._all: list[_Worker] = []
        self._lock = threading.Lock()

    def check(self, reference: str, answer: str, rational: tuple[int, int] | None, timeout_s: float) -> str:
        verdict = self.check_pairs([(reference, answer, rational)], timeout_s)
        if isinstance(verdict, str):
            return verdict
        return "equal" if verdict[0] else "different"

    def check_pairs(self, pairs: list[tuple[str, str, tuple[int, int] | None]],
                    timeout_s: float) -> list[bool] | str:
        """One verdict per (reference, answer, rational) pair, or "timeout"/"infra" for the whole batch."""
        request = {"pairs": [[reference, answer, list(rational) if rational else None]
                             for reference, answer, rational in pairs]}
        worker = self._idle.get()
        try:
            if worker is None or worker.process.poll() is not None:
                worker = _Worker()
                with self._lock:
                    self._all.append(worker)
            reply = worker.ask(request, timeout_s)
        except (OSError, RuntimeError, ValueError):
            if worker is not None:
                worker.kill()
            self._idle.put(None)
            return "infra"
        if reply is None:  # no answer in time: the comparison is abandoned with its process
            worker.kill()
            self._idle.put(None)
            return "timeout"
        self._idle.put(worker)
        verdicts = reply.get("equal")
        if not isinstance(verdicts, list) or len(verdicts) != len(pairs):
            return [False] * len(pairs)  # the worker could not compare them (its error): different
        return [bool(v) for v in verdicts]

    def close(self) -> None:
        with self._lock:
            for worker in self._all:
                worker.kill()
            self._all.clear()


_workers: MathWorkers | None = None
_workers_lock = threading.Lock()


def math_workers() -> MathWorkers:
    global _workers
    with _workers_lock:
        if _workers is None:
            _workers = MathWorkers(size=max(1, min(4, os.cpu_count() or 1)))
        return _workers


@atexit.register
def _close() -> None:
    if _workers is not None:
        _workers.close()
