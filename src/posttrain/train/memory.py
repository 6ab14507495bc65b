"""Peak memory of a training step, and what it costs per token.

On CUDA: torch's allocator peak (``max_memory_allocated``), reset at the start of each step. On CPU there is
no allocator counter, so the process's resident-set high-water mark is read (``VmHWM`` in
``/proc/self/status``) after resetting it (writing ``5`` to ``/proc/self/clear_refs``, Linux >= 4.0). Where
the reset is refused the mark is the process's lifetime peak, and `PeakMemory.resettable` says so.

``activation_kb_per_token`` is the step's peak above the memory held when it started (weights, optimizer
state, data), divided by the largest micro-batch's tokens: what one more token of sequence costs.
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _rss_kb(field: str) -> float | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return float(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """``start()`` before a step, ``figures(tokens)`` after it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.resettable = True
        self._base_mb = 0.0

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base_mb = torch.cuda.memory_allocated(self.device) / 2**20
            return
        try:
            _CLEAR_REFS.write_text("5")
        except OSError:
            self.resettable = False
        self._base_mb = (_rss_kb("VmRSS") or 0.0) / 1024

    def peak_mb(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        peak_kb = _rss_kb("VmHWM")
        if peak_kb is None:  # no procfs: ru_maxrss is kilobytes on Linux
            peak_kb = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        return peak_kb / 1024

    def figures(self, micro_batch_tokens: int) -> dict[str, float]:
        """``peak_memory_mb`` and ``activation_kb_per_token`` of the step since `start`."""
        peak = self.peak_mb()
        above = max(0.0, peak - self._base_mb)
        return {"peak_memory_mb": peak, "activation_kb_per_token": above * 1024 / max(micro_batch_tokens, 1)}
