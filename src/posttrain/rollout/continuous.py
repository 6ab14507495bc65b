"""`ContinuousBatcher`: requests join and leave a running batch at every decode step (for serving).

`HFEngine.generate` runs a fixed batch to the end; a server cannot wait for that. Here every request is
submitted on its own (any thread; `submit_many` queues several at once, so they start at the same step), and the loop (`run`, or `step` called by hand) does, per decode step:

1. drops the rows of cancelled requests (a client that went away frees its slot at once);
2. admits waiting requests while there is room (``max_batch_size`` rows): their prompts are prefilled and
   *joined* to the running rows (`DecoderRunner.join`), so their first token is sampled in this very step. A
   request that finds the batch empty starts at once; into a running batch, arrivals join together, when they
   are enough (`JOIN_RATIO` of the running rows, or the rest of the batch) or the oldest has waited a few steps
   (`MAX_JOIN_WAIT_STEPS`), since each join copies the batch's KV once;
3. samples one token per row — each row with its own request's temperature, top-p, top-k and random stream —
   and hands the tokens to each request (`StreamRequest.drain`, plus one ``on_step`` call per step for a
   caller that waits on another thread or event loop);
4. stops each row by its request's `StopRule` (a vision-language model's reply ends before an image placeholder
   token, as in the engine's ``generate``), drops the finished rows, and runs the next decode step.

The model maths is the engine's own runner (a second `DecoderRunner` on the same weights, so the engine's
``generate`` can still run beside it), and the sampling is `Sampler`'s per row: a seeded request draws from
the stream ``stream_seed(seed, 0, j)`` for its sample j, exactly as ``engine.generate([request],
request_seeds=[seed])`` does, so served and offline samples agree token for token (to float rounding of the
logits; greedy outputs are equal unless two logits tie within rounding).

Both runners join: the fast decoder folds the running rows' KV into prompt slots (`DecoderRunner.join`), the
generic runner (every other family: sliding windows, soft-caps, fused projections...) stacks transformers'
dynamic cache layers, left-padding the shorter (`GenericRunner.join`). A model whose cache has other layer
kinds (static, quantized, linear attention) cannot be stacked: its waiting requests are admitted when the batch
has drained — correct, but not continuous.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from posttrain.rollout.decoder import DecoderRunner
from posttrain.rollout.engine import HFEngine
from posttrain.rollout.errors import RolloutError
from posttrain.rollout.generic import GenericRunner
from posttrain.rollout.sampling import check_sampling, stream_seed, unseeded
from posttrain.rollout.stopping import StopRule
from posttrain.types import Completion, SamplingParams

log = logging.getLogger(__name__)

# When waiting requests join a running batch. A join costs a prefill of the new prompts plus one copy of the
# running rows' KV (their fold), about two decode steps of a 64-row tiny-3m batch here; admitting every arrival
# at the very next step turns clients that trickle in one per step into one join each (64 arrivals, one per step:
# 95 steps and 1.7 s, against 32 steps and 0.23 s when they come together). So a join waits until the waiting
# rows are at least JOIN_RATIO times the running ones, or would fill the batch, or the oldest has waited
# MAX_JOIN_WAIT_STEPS steps (the rule of TGI's waiting-served ratio and max waiting tokens): arrivals then join in
# a geometric series, a few joins for a burst of any size, and none waits more than a few steps.
JOIN_RATIO = 0.5
MAX_JOIN_WAIT_STEPS = 4

# KV columns reserved per join and per growth: a request asking for its whole context does not allocate it up
# front (64 rows x 1000 columns of tiny-3m's KV is ~0.5 GB), the cache grows as its rows get there.
_CAPACITY_STEP = 128


def check_room(prompt: Sequence[int], max_new_tokens: int, vocab_size: int, max_length: int | None) -> int:
    """How many tokens a prompt may generate (at most `max_new_tokens`); RolloutError when it cannot."""
    if not prompt:
        raise RolloutError("empty prompt (the engine needs at least one prompt token)")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise RolloutError(f"token ids must be in [0, {vocab_size}) for this model")
    limit = max_new_tokens
    if max_length is not None:
        limit = min(limit, max_length - len(prompt))
        if limit < 1:
            raise RolloutError(f"a prompt of {len(prompt)} tokens leaves no room in the model's context of "
                               f"{max_length} tokens")
    return limit


def check_request(prompt: Sequence[int], sampling: SamplingParams, vocab_size: int, max_length: int | None,
                  max_batch_size: int) -> int:
    """What `ContinuousBatcher.submit` checks (a RolloutError names what is wrong); the request's token limit."""
    check_sampling(sampling)
    limit = check_room(prompt, sampling.max_new_tokens, vocab_size, max_length)
    if sampling.n > max_batch_size:
        raise RolloutError(f"n={sampling.n} is more than the batch holds ({max_batch_size} rows)")
    return limit


@dataclass
class SequenceEvent:
    """What one decode step produced for sequence `index` of a request (one token, and the end when it ended)."""

    index: int
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    completion: Completion | None = None  # set on the sequence's last event: the cut tokens, text, reason


class StreamRequest:
    """One prompt with ``sampling.n`` sequences, submitted to a `ContinuousBatcher`.

    Events arrive as the loop produces them; `drain` takes those not yet taken (safe from any thread).
    ``top_logprobs`` asks for that many most likely tokens (with logprobs) at every step; ``ignore_eos``
    samples past the end-of-sequence token (fixed-length outputs, for benchmarks and tests).
    """

    def __init__(self, prompt_token_ids: Sequence[int], sampling: SamplingParams, *, top_logprobs: int = 0,
                 request_id: str = "", ignore_eos: bool = False):
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling = sampling
        self.top_logprobs = top_logprobs
        self.ignore_eos = ignore_eos  # stop only on stop strings, stop_token_ids and length (benchmarks)
        self.request_id = request_id
        self.completions: list[Completion | None] = [None] * sampling.n
        self.error: Exception | None = None
        self.cancelled = False
        self.submitted_s = time.monotonic()
        self.first_token_s: float | None = None
        self._events: deque[SequenceEvent] = deque()

    @property
    def done(self) -> bool:
        return self.error is not None or self.cancelled or all(c is not None for c in self.completions)

    @property
    def finished(self) -> bool:
        """Done, and every event taken (`drain`)."""
        return self.done and not self._events

    def deliver(self, events: list[SequenceEvent], error: Exception | None = None) -> None:
        """Hand the request new events (the loop's side, or whatever relays the loop's events: the first one stamps
        `first_token_s`, a sequence's last one records its completion) and, when it failed, the error."""
        if events and self.first_token_s is None:
            self.first_token_s = time.monotonic()
        for event in events:
            if event.completion is not None:
                self.completions[event.index] = event.completion
        self._events.extend(events)
        if error is not None:
            self.error = error

    def drain(self) -> list[SequenceEvent]:
        events = []
        while self._events:
            events.append(self._events.popleft())
        return events


class _Row:
    """One running sequence: its request, sampling settings, random stream and what it produced so far."""

    def __init__(self, request: StreamRequest, index: int, limit: int, rule: StopRule, seed: int, version: int):
        sampling = request.sampling
        self.request, self.index, self.limit, self.rule, self.version = request, index, limit, rule, version
        self.greedy = sampling.temperature == 0
        self.temperature = 1.0 if self.greedy else float(sampling.temperature)
        self.top_p, self.top_k = sampling.top_p, sampling.top_k
        # Drawn up front like `Sampler` (a prefix of the same stream whatever the limit).
        self.uniforms = None if self.greedy else torch.rand(limit, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []
        self.reason: str | None = None

    def record(self, token: int, logprob: float, top: list[tuple[int, float]]) -> SequenceEvent:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.tops.append(top)
        if token in self.rule.placeholder_ids:  # a VLM's image token: the reply ends before it (`rollout.stopping`)
            self.reason = "placeholder"
        elif token in self.rule.stop_ids:
            self.reason = "token"
        elif self.rule.strings and self.rule.string_hits([self.tokens])[0]:
            self.reason = "string"
        elif len(self.tokens) >= self.limit:
            self.reason = "length"
        event = SequenceEvent(self.index, token, logprob, top)
        if self.reason is not None:
            ids, logprobs, text = self.rule.cut(self.tokens, self.logprobs, self.reason)
            reason = "length" if self.reason == "length" else "stop"
            event.completion = Completion(ids, text, logprobs, reason, self.version, self.request.request_id)
        return event


class _BatchSettings:
    """The per-row sampling settings as tensors, rebuilt whenever rows join or leave."""

    def __init__(self, rows: list[_Row], device: torch.device):
        self.temperature = torch.tensor([[r.temperature] for r in rows], device=device)
        self.scale = any(r.temperature != 1.0 for r in rows)
        self.greedy = torch.tensor([r.greedy for r in rows], device=device)
        self.any_sampled = not all(r.greedy for r in rows)
        self.top_p = torch.tensor([[r.top_p] for r in rows], device=device)
        self.truncate_p = torch.tensor([r.top_p < 1.0 for r in rows], device=device)
        self.any_top_p = any(r.top_p < 1.0 for r in rows)
        self.top_k = torch.tensor([r.top_k for r in rows], device=device)
        self.max_top_k = max((r.top_k for r in rows), default=0)
        self.top_logprobs = max((r.request.top_logprobs for r in rows), default=0)


class ContinuousBatcher:
    """Continuous batching over an `HFEngine`'s model; see the module docstring.

    ``on_step(requests)`` is called once per decode step (on the loop's thread) with the requests that got
    events in it. ``max_batch_size`` (rows) defaults to the engine's. ``join_ratio`` and
    ``max_join_wait_steps`` say when waiting requests join a running batch (see `JOIN_RATIO`; ``join_ratio=0``
    joins every arrival at the next step). A request that finds the batch empty starts at once.
    """

    def __init__(self, engine: HFEngine, *, max_batch_size: int | None = None,
                 on_step: Callable[[list[StreamRequest]], None] | None = None, join_ratio: float = JOIN_RATIO,
                 max_join_wait_steps: int = MAX_JOIN_WAIT_STEPS):
        if join_ratio < 0 or max_join_wait_steps < 0:
            raise RolloutError("join_ratio and max_join_wait_steps must not be negative")
        self.engine = engine
        self.max_batch_size = max_batch_size or engine.max_batch_size
        self.join_ratio, self.max_join_wait_steps = join_ratio, max_join_wait_steps
        self.joins = 0  # prefills into a running batch (each copies the batch's KV once)
        self._waiting_since: int | None = None  # the step at which the oldest waiting request was first seen
        self.on_step = on_step
        self.device = engine.device
        if engine.runner == "fast":
            self._runner: DecoderRunner | GenericRunner = DecoderRunner(engine.model, engine.autocast,
                                                                        prepack=engine.prepack_weights)
        else:
            self._runner = GenericRunner(engine.model, engine.autocast)
        self._rows: list[_Row] = []
        self._settings = _BatchSettings([], self.device)
        self._logits: torch.Tensor | None = None  # next-token logits of the running rows
        self._capacity = 0  # KV columns the runner holds per row since the last join
        self._waiting: deque[StreamRequest] = deque()
        self._wake = threading.Condition()
        self.steps = 0
        self.completion_tokens = 0

    # ---- the caller's side (any thread) -------------------------------------------------------------

    def submit(self, request: StreamRequest) -> StreamRequest:
        """Queue `request` (validated now: a RolloutError names what is wrong); it joins at the next step."""
        for _, error in self.submit_many([request]):
            raise error
        return request

    def submit_many(self, requests: list[StreamRequest]) -> list[tuple[StreamRequest, RolloutError]]:
        """Queue `requests` at once, so that they are admitted at the same step (one prefill, not one per
        request as the loop would take them when they came one by one); returns the refused ones, with why."""
        accepted, refused = [], []
        for request in requests:
            try:
                check_request(request.prompt_token_ids, request.sampling, self.engine.vocab_size,
                              self.engine.max_length, self.max_batch_size)
                accepted.append(request)
            except RolloutError as error:
                refused.append((request, error))
        if accepted:
            with self._wake:
                self._waiting.extend(accepted)
                self._wake.notify()
        return refused

    def cancel(self, request: StreamRequest) -> None:
        """Stop `request`: its rows leave the batch at the next step."""
        request.cancelled = True
        with self._wake:
            self._wake.notify()

    def room(self, prompt: Sequence[int], max_new_tokens: int) -> int:
        """How many tokens a prompt may generate (at most `max_new_tokens`); RolloutError when it cannot."""
        return check_room(prompt, max_new_tokens, self.engine.vocab_size, self.engine.max_length)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._rows)

    # ---- the loop ------------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Step until `stop` is set, sleeping while there is nothing to do. Run it on the thread that owns
        torch's threads (the main thread on a CPU: see docs/rollout.md)."""
        if self.engine.num_threads is not None:
            torch.set_num_threads(self.engine.num_threads)
        while not stop.is_set():
            if not self.step():
                with self._wake:
                    if not self._waiting and not stop.is_set():
                        self._wake.wait(timeout=0.05)

    def step(self) -> bool:
        """One decode step for every running row (admitting waiting requests first); False when idle."""
        try:
            with torch.inference_mode():
                updated = self._step()
        except Exception as error:  # noqa: BLE001 - fail the requests in the batch, keep serving the rest
            log.exception("continuous batcher: a step failed; failing its %d rows", len(self._rows))
            updated = self._fail_all(error)
        if updated and self.on_step is not None:
            self.on_step(updated)
        return bool(self._rows or self._waiting)

    def _step(self) -> list[StreamRequest]:
        self._keep([row for row in self._rows if not row.request.cancelled])
        self._admit()
        if not self._rows:
            return []
        tokens, logprobs, tops = self._sample(self._logits)
        produced: dict[int, tuple[StreamRequest, list[SequenceEvent]]] = {}
        for row, token, logprob, top in zip(self._rows, tokens, logprobs, tops):
            produced.setdefault(id(row.request), (row.request, []))[1].append(row.record(token, logprob, top))
        for request, events in produced.values():
            request.deliver(events)
        self.steps += 1
        self.completion_tokens += len(tokens)
        alive = [position for position, row in enumerate(self._rows) if row.reason is None]
        sampled = torch.tensor(tokens, device=self.device)
        if len(alive) < len(self._rows):
            self._keep([self._rows[p] for p in alive], positions=alive)
            sampled = sampled[alive]
        if self._rows:
            self._reserve()
            self._logits = self._runner.decode(sampled)
        return [request for request, _ in produced.values()]

    # ---- rows joining and leaving -------------------------------------------------------------------

    def _join_now(self) -> bool:
        """Whether the waiting requests join the running batch at this step (see `JOIN_RATIO`)."""
        if not self._rows:
            return True
        if self._waiting_since is None:
            self._waiting_since = self.steps
        waiting = sum(r.sampling.n for r in list(self._waiting) if not r.cancelled)
        free = self.max_batch_size - len(self._rows)
        return (waiting >= min(free, self.join_ratio * len(self._rows))
                or self.steps - self._waiting_since >= self.max_join_wait_steps)

    def _admit(self) -> None:
        if not self._waiting:
            self._waiting_since = None
            return
        if self._rows and not self._can_join():
            return  # a cache that cannot be stacked takes new prompts only into an empty batch
        if not self._join_now():
            return
        admitted: list[StreamRequest] = []
        free = self.max_batch_size - len(self._rows)
        while self._waiting and (self._waiting[0].cancelled or self._waiting[0].sampling.n <= free):
            request = self._waiting.popleft()
            if request.cancelled:
                continue
            admitted.append(request)
            free -= request.sampling.n
        self._waiting_since = None if not self._waiting else self.steps  # who is left (no room) waits afresh
        if not admitted:
            return
        version = self.engine.policy_version
        for n in sorted({r.sampling.n for r in admitted}):  # one join per group size (the runner's prefill)
            group = [r for r in admitted if r.sampling.n == n]
            if self._rows and not self._can_join():  # back to the queue's head, in arrival order
                self._waiting.extendleft(reversed([r for r in admitted if r.sampling.n >= n]))
                break
            new_rows = [row for r in group for row in self._rows_for(r, version)]
            remaining = [row.limit - len(row.tokens) for row in self._rows + new_rows]
            capacity = min(max(remaining), _CAPACITY_STEP)
            prompts = [r.prompt_token_ids for r in group]
            if self._rows:
                logits = self._runner.join(prompts, n, capacity)
                self.joins += 1
                self._logits = torch.cat([self._logits, logits])
            else:
                self._logits = self._runner.prefill(prompts, n, capacity)
            self._capacity = capacity
            self._rows += new_rows
        self._settings = _BatchSettings(self._rows, self.device)

    def _can_join(self) -> bool:
        return isinstance(self._runner, DecoderRunner) or self._runner.joinable()

    def _rows_for(self, request: StreamRequest, version: int) -> list[_Row]:
        sampling = request.sampling
        limit = self.room(request.prompt_token_ids, sampling.max_new_tokens)
        rule = StopRule(self.engine.tokenizer, () if request.ignore_eos else self.engine.eos_ids, sampling,
                        self.engine.placeholder_ids)
        seed = unseeded() if sampling.seed is None else sampling.seed
        return [_Row(request, j, limit, rule, stream_seed(seed, 0, j), version) for j in range(sampling.n)]

    def _keep(self, rows: list[_Row], positions: list[int] | None = None) -> None:
        """Keep only `rows` (a subsequence of the running rows, at `positions` when known)."""
        if len(rows) == len(self._rows):
            return
        if not rows:
            self._runner.release()
            self._rows, self._logits, self._capacity = [], None, 0
        else:
            if positions is None:
                kept = {id(r) for r in rows}
                positions = [p for p, r in enumerate(self._rows) if id(r) in kept]
            index = torch.tensor(positions, device=self.device)
            self._runner.keep(index)
            if self._logits is not None and len(self._logits) == len(self._rows):
                self._logits = self._logits[index]
            self._rows = rows
        self._settings = _BatchSettings(self._rows, self.device)

    def _reserve(self) -> None:
        """Grow the runner's KV columns before a row would write past them (the generic cache grows itself)."""
        if not isinstance(self._runner, DecoderRunner):
            return
        runner: DecoderRunner = self._runner  # type: ignore[assignment]
        if runner.length < self._capacity:
            return
        needed = max(row.limit - len(row.tokens) for row in self._rows)
        self._capacity = runner.length + min(needed, _CAPACITY_STEP)
        runner.reserve(self._capacity)

    def _fail_all(self, error: Exception) -> list[StreamRequest]:
        failed = {id(row.request): row.request for row in self._rows}
        for request in failed.values():
            request.error = RolloutError(f"generation failed: {error}")
        self._runner.release()
        self._rows, self._logits, self._capacity = [], None, 0
        self._settings = _BatchSettings([], self.device)
        return list(failed.values())

    # ---- sampling: `Sampler`'s maths with per-row settings --------------------------------------------

    def _sample(self, logits: torch.Tensor) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
        settings, rows = self._settings, self._rows
        scaled = logits / settings.temperature if settings.scale else logits
        logprobs = torch.log_softmax(scaled, dim=-1)
        tokens = logits.argmax(-1)  # greedy rows (temperature 1: the same argmax as Sampler's)
        if settings.any_sampled:
            uniforms = torch.tensor([0.0 if r.uniforms is None else r.uniforms[len(r.tokens)] for r in rows],
                                    device=self.device)
            tokens = torch.where(settings.greedy, tokens, self._draw(logprobs, uniforms))
        chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
        tops: list[list[tuple[int, float]]] = [[] for _ in rows]
        if settings.top_logprobs:
            values, ids = torch.topk(logprobs, min(settings.top_logprobs, logprobs.shape[-1]), dim=-1)
            values, ids = values.tolist(), ids.tolist()
            for position, row in enumerate(rows):
                k = row.request.top_logprobs
                tops[position] = list(zip(ids[position][:k], values[position][:k]))
        return tokens.tolist(), chosen.tolist(), tops

    def _draw(self, logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        settings = self._settings
        weights = logprobs.exp()
        vocab = weights.shape[-1]
        if settings.max_top_k:
            values = torch.topk(logprobs, min(settings.max_top_k, vocab), dim=-1).values
            kth = values.gather(-1, (settings.top_k.clamp(1, values.shape[-1]) - 1)[:, None])
            applies = ((settings.top_k > 0) & (settings.top_k < vocab))[:, None]
            weights = weights.masked_fill(applies & (logprobs < kth), 0.0)
        if settings.any_top_p:
            ordered, order = weights.sort(dim=-1, descending=True)
            cumulative = ordered.cumsum(-1)
            drop = (cumulative - ordered) >= settings.top_p * cumulative[:, -1:]
            truncated = weights.scatter(-1, order, ordered.masked_fill(drop, 0.0))
            weights = torch.where(settings.truncate_p[:, None], truncated, weights)
        cdf = weights.cumsum(-1)
        tokens = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True).squeeze(-1)
        return torch.minimum(tokens, cdf.argmax(-1))
