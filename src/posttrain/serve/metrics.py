"""Server metrics in the Prometheus text exposition format (``GET /metrics``), kept by hand: a few counters,
two gauges read at scrape time and two histograms need no client library."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Histogram:
    def __init__(self) -> None:
        self.counts = [0] * len(_BUCKETS_S)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for index, bound in enumerate(_BUCKETS_S):
            if value <= bound:
                self.counts[index] += 1
        self.total += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        lines = [f'{name}_bucket{{le="{bound}"}} {count}' for bound, count in zip(_BUCKETS_S, self.counts)]
        lines += [f'{name}_bucket{{le="+Inf"}} {self.total}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.total}"]
        return lines


class Metrics:
    """Requests by endpoint and status, tokens in and out, queue depth, time to first token, latency."""

    def __init__(self, queue_depth: Callable[[], int], running: Callable[[], int]):
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft = _Histogram()
        self.latency = _Histogram()
        self._queue_depth, self._running = queue_depth, running

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def tokens(self, prompt: int, completion: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.completion_tokens += completion

    def timings(self, ttft_s: float | None, latency_s: float) -> None:
        with self._lock:
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
            self.latency.observe(latency_s)

    def render(self) -> str:
        with self._lock:
            lines = ["# HELP posttrain_requests_total HTTP requests by endpoint and status.",
                     "# TYPE posttrain_requests_total counter"]
            lines += [f'posttrain_requests_total{{endpoint="{endpoint}",status="{status}"}} {count}'
                      for (endpoint, status), count in sorted(self.requests.items())]
            lines += ["# HELP posttrain_prompt_tokens_total Prompt tokens of served requests.",
                      "# TYPE posttrain_prompt_tokens_total counter",
                      f"posttrain_prompt_tokens_total {self.prompt_tokens}",
                      "# HELP posttrain_completion_tokens_total Completion tokens sent.",
                      "# TYPE posttrain_completion_tokens_total counter",
                      f"posttrain_completion_tokens_total {self.completion_tokens}",
                      "# HELP posttrain_queue_depth Requests waiting to join the batch.",
                      "# TYPE posttrain_queue_depth gauge",
                      f"posttrain_queue_depth {self._queue_depth()}",
                      "# HELP posttrain_running_sequences Sequences in the running batch.",
                      "# TYPE posttrain_running_sequences gauge",
                      f"posttrain_running_sequences {self._running()}",
                      "# HELP posttrain_time_to_first_token_seconds From request to its first sampled token.",
                      "# TYPE posttrain_time_to_first_token_seconds histogram",
                      *self.ttft.lines("posttrain_time_to_first_token_seconds"),
                      "# HELP posttrain_request_latency_seconds From request to its last token.",
                      "# TYPE posttrain_request_latency_seconds histogram",
                      *self.latency.lines("posttrain_request_latency_seconds")]
        return "\n".join(lines) + "\n"
