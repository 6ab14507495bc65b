"""`HFEngine`: the built-in inference engine, on any Hugging Face causal LM, CPU or CUDA.

One `generate` call runs its requests in chunks of at most ``max_batch_size`` sequences. A chunk:

1. prefills each distinct prompt once (left-padded together, position ids counting real tokens only);
2. gives each prompt ``n`` sequences (rows) that share its KV (`DecoderRunner`) or get a copy of it;
3. decodes one token per running sequence per step, sampling with `Sampler` (the logprob reported is
   ``log_softmax(logits / T)`` of the sampled token, before top-k/top-p);
4. stops each sequence on its own (`StopRule`: eos / stop tokens / stop strings / length) and compacts the
   batch once an eighth of it has finished, so finished sequences stop costing compute.

A request may be an image prompt (``GenerationRequest.image_inputs``: a vision-language model's pixel tensors,
its ids already holding the image tokens; `posttrain.models.vision_request` builds one): the generic runner feeds
the images to the prefill and decodes as for text, so the tokens and logprobs follow the same rules (Qwen2-VL's
3-D rotary positions included: `GenericRunner`); a reply ends before an image placeholder token the model samples
(`rollout.stopping`). The fast decoder and speculative decoding take text prompts only.

Two runners do the model maths: `DecoderRunner` (Llama-family models: preallocated KV caches, the prompt's
shared by its group, a flat layer loop; the fast path measured in docs/rollout.md) and `GenericRunner`
(anything, through ``model.forward``). Both give the logprobs of a teacher-forced forward pass of the model, to
float rounding.

`update_weights` copies a state dict into the model in place and tags later completions with its version; a
lock makes it wait for a running `generate`, so every token of a completion comes from the version it reports.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from posttrain.models import context_length, image_placeholder_ids
from posttrain.rollout.decoder import PREFILL_CHUNK, DecoderRunner, fast_path_unsupported
from posttrain.rollout.errors import RolloutError
from posttrain.rollout.generic import GenericRunner
from posttrain.rollout.sampling import Sampler, check_sampling, stream_seed, unseeded
from posttrain.rollout.speculative import Speculation, Speculator
from posttrain.rollout.stopping import StopRule, eos_token_ids
from posttrain.rollout.weights import check_state, copy_state
from posttrain.types import Completion, GenerationRequest, SamplingParams

log = logging.getLogger(__name__)

# The fast decoder's KV cache is widened to float32 (faster to read on CPU) only while it stays under this many
# MiB and the chunk's prompts are shorter than LONG_PROMPT tokens; beyond, it is kept in the model's dtype.
KV_WIDEN_LIMIT_MB = 256.0
LONG_PROMPT = 2048

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineStats:
    """Running totals, for throughput logs and for callers that want to know how the engine was used."""

    generate_calls: int = 0
    chunks: int = 0
    sequences: int = 0
    completion_tokens: int = 0
    generate_s: float = 0.0
    weight_updates: int = 0
    update_s: float = 0.0
    last_update_s: float | None = None
    peak_kv_mb: float = 0.0  # the largest KV cache a chunk held (fast decoder: prompt and generated parts)
    kv_cache_dtype: str = ""  # the storage dtype of the last chunk's KV cache
    # speculative decoding (`posttrain.rollout.speculative`): rounds, tokens drafted, drafts the target accepted
    speculative_rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted tokens (None before any speculative round drafted one)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def tokens_per_s(self) -> float | None:
        """Completion tokens per second of `generate` calls so far."""
        return self.completion_tokens / self.generate_s if self.generate_s > 0 else None


class _Record:
    """Every row's sampled tokens and logprobs, and why it stopped (None while it runs)."""

    def __init__(self, row_limits: list[int], rule: StopRule):
        self.limits, self.rule = row_limits, rule
        self.tokens: list[list[int]] = [[] for _ in row_limits]
        self.logprobs: list[list[float]] = [[] for _ in row_limits]
        self.reasons: list[str | None] = [None] * len(row_limits)

    def add(self, batch: list[int | None], tokens: list[int], logprobs: list[float]) -> list[int | None]:
        """Record one step's token per running row; returns `batch` with the rows that stopped set to None."""
        running = []
        for row, token, logprob in zip(batch, tokens, logprobs):
            if row is None:
                continue
            self.tokens[row].append(token)
            self.logprobs[row].append(logprob)
            if token in self.rule.placeholder_ids:
                self.reasons[row] = "placeholder"
            elif token in self.rule.stop_ids:
                self.reasons[row] = "token"
            else:
                running.append(row)
        for row, hit in zip(running, self.rule.string_hits([self.tokens[r] for r in running])):
            if hit:
                self.reasons[row] = "string"
            elif len(self.tokens[row]) >= self.limits[row]:
                self.reasons[row] = "length"
        return [row if row is not None and self.reasons[row] is None else None for row in batch]

    def completions(self) -> list[tuple[list[int], list[float], str, str]]:
        """(token ids, logprobs, text, finish reason) per row, cut by the stop rule."""
        outputs = []
        for tokens, logprobs, reason in zip(self.tokens, self.logprobs, self.reasons):
            reason = reason or "length"
            ids, kept_logprobs, text = self.rule.cut(tokens, logprobs, reason)
            outputs.append((ids, kept_logprobs, text, "length" if reason == "length" else "stop"))
        return outputs


def _dtype(value: torch.dtype | str | None, what: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if value in _DTYPES:
        return _DTYPES[value]
    raise RolloutError(f"HFEngine: {what}={value!r}; use one of {sorted(_DTYPES)} or a torch dtype")


class HFEngine:
    """Batched sampling with a KV cache on a Hugging Face causal LM; see the module docstring.

    The engine owns ``model`` from here on: it is put in eval mode and, when asked, moved to ``device`` and
    cast to ``dtype`` in place. To keep training the original, give the engine a copy and push the trained
    weights with `update_weights`. ``autocast`` (e.g. ``"bfloat16"``) runs the matmuls in that dtype with
    the parameters as they are — the numerics of a trainer under `torch.autocast`. ``runner`` picks the
    model maths: ``"auto"`` (the fast decoder when the architecture allows), ``"fast"`` or ``"generic"``.
    ``num_threads`` sets torch's intra-op threads for the thread that runs `generate` (per thread in torch's
    OpenMP builds), so a rollout thread and a training thread can split the cores instead of oversubscribing.
    ``compile=True`` runs the fast decoder's decode step under torch.compile (one graph for the whole step,
    dynamic shapes; on a 2-core AVX2 VM in fp32, ~65 CPU-s to compile cold, ~18 from the persistent compile cache,
    then 1.15x the eager tokens per CPU-second on tiny-3m: worth it for a long-lived engine, not for one call).
    ``speculative`` (a `Speculation`) decodes by speculative rounds: a draft model or prompt lookup proposes
    tokens, the model verifies them (same output distribution and logprobs; `posttrain.rollout.speculative`).
    ``share_prompts=True`` prefills a prompt that several requests of one call carry (an RL group's episodes,
    each its own request with its own seed) once, its rows sharing its KV, as one request with ``n`` samples
    does: each row keeps its seed stream and its place in the results. On the demo's RL batch (16 code prompts of
    ~70-110 tokens x 8 episodes, bf16) 2.5-3x faster; the rows' numerics are the shared layout's, not
    bit-identical to separate prefills (fp32 logprobs differ in the last bits), so off for a bare engine; RL's
    recipe turns it on (`rollout.share_prompts`, docs/rollout.md).
    ``prepack_weights`` (on) runs the fast decoder's eager linears on CPU through weights prepacked for oneDNN
    (`posttrain.models.kernels`): fp32 ~2x the `F.linear` rate where MKL runs below the core's peak (an AMD EPYC
    with AVX-512), bf16 faster and bit-identical; the price is one more copy of the linear weights per runner
    (continuous batching and speculative decoding have runners of their own); off, `F.linear`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        autocast: torch.dtype | str | None = None,
        max_batch_size: int = 64,
        policy_version: int = 0,
        runner: Literal["auto", "fast", "generic"] = "auto",
        num_threads: int | None = None,
        compile: bool = False,
        kv_cache_dtype: Literal["auto", "model", "float32"] = "auto",
        kv_widen_limit_mb: float = KV_WIDEN_LIMIT_MB,
        prefill_chunk: int | None = PREFILL_CHUNK,
        speculative: Speculation | None = None,
        share_prompts: bool = False,
        prepack_weights: bool = True,
    ):
        if hasattr(model, "peft_config"):
            raise RolloutError(
                "HFEngine: give the engine a plain model, not a PEFT one: merge the adapter "
                "(posttrain.models.merged_copy) and push later weights with "
                "engine.update_weights(posttrain.rollout.state_for_engine(peft_model), version)"
            )
        if max_batch_size < 1:
            raise RolloutError(f"HFEngine: max_batch_size must be >= 1, got {max_batch_size}")
        if device is not None:
            model.to(device)
        cast = _dtype(dtype, "dtype")
        if cast is not None:
            model.to(cast)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.autocast = _dtype(autocast, "autocast")
        self.max_batch_size = max_batch_size
        self.num_threads = num_threads
        self.device = next(model.parameters()).device
        self.eos_ids = eos_token_ids(tokenizer, model)
        self.placeholder_ids = image_placeholder_ids(model)  # a VLM's image/video tokens: never in a reply
        self.vocab_size = model.get_input_embeddings().num_embeddings
        # extended by model.rope_scaling where set; a vision-language model's is its language model's
        self.max_length = context_length(getattr(model.config, "text_config", None) or model.config)
        self._version = policy_version
        self._lock = threading.Lock()
        self.stats = EngineStats()
        if kv_cache_dtype not in ("auto", "model", "float32"):
            raise RolloutError(f"HFEngine: kv_cache_dtype={kv_cache_dtype!r}; use 'auto', 'model' or 'float32'")
        self.kv_cache_dtype, self.kv_widen_limit_mb = kv_cache_dtype, kv_widen_limit_mb
        self.prefill_chunk = prefill_chunk
        self.share_prompts = share_prompts
        self.prepack_weights = prepack_weights
        self._runner = self._make_runner(runner, compile)
        self._speculator = None if speculative is None else Speculator(self.model, self.autocast, speculative,
                                                                         prepack_weights)
        if speculative is not None:
            log.info("HFEngine: speculative decoding (%s, %d tokens per round)", speculative.name or speculative.kind,
                     speculative.num_tokens)

    def _make_runner(self, choice: str, compile: bool) -> DecoderRunner | GenericRunner:
        reason = fast_path_unsupported(self.model)
        if choice == "fast" and reason is not None:
            raise RolloutError(f"HFEngine(runner='fast'): {reason}; use runner='auto' or 'generic'")
        if choice == "generic" or reason is not None:
            if choice == "auto":
                # A rope scaling the fast decoder cannot take is the user's choice of model: say so loudly.
                loud = reason is not None and "rope type" in reason
                (log.warning if loud else log.info)("HFEngine: generic runner (%s)", reason)
            return GenericRunner(self.model, self.autocast)
        return DecoderRunner(self.model, self.autocast, compile=compile, prefill_chunk=self.prefill_chunk,
                             prepack=self.prepack_weights)

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def runner(self) -> str:
        return "fast" if isinstance(self._runner, DecoderRunner) else "generic"

    # ---- generate -------------------------------------------------------------------------------------

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        sampling: SamplingParams,
        *,
        request_seeds: Sequence[int | None] | None = None,
    ) -> list[list[Completion]]:
        """Per request, ``sampling.n`` completions.

        With ``sampling.seed`` set, completion j of request i draws from the stream (seed, i, j): the same
        call gives the same tokens. ``request_seeds`` (one per request; None = unseeded) replaces it with
        a stream per request that does not depend on the request's place in the call: a request with seed
        s samples exactly what ``generate([request], sampling with seed=s)`` samples (the batcher uses this).
        """
        check_sampling(sampling)
        self._check_images(requests)
        prompts = [list(r.prompt_token_ids) for r in requests]
        limits = [self._room(i, r, prompt, sampling) for i, (r, prompt) in enumerate(zip(requests, prompts))]
        streams = self._streams(len(requests), sampling, request_seeds)
        started = time.perf_counter()
        threads_before = torch.get_num_threads() if self.num_threads is not None else None
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        try:
            with self._lock, torch.inference_mode():
                version = self._version
                results: list[list[Completion]] = [[] for _ in requests]
                for chunk in self._chunks(prompts, sampling.n):
                    outputs = self._run_chunk(
                        [prompts[i] for i in chunk],
                        [limits[i] for i in chunk],
                        [stream_seed(*streams[i], j) for i in chunk for j in range(sampling.n)],
                        sampling,
                        [requests[i].image_inputs for i in chunk],
                    )
                    for position, index in enumerate(chunk):
                        for ids, logprobs, text, reason in outputs[position * sampling.n : (position + 1) * sampling.n]:
                            results[index].append(
                                Completion(ids, text, logprobs, reason, version, requests[index].request_id)
                            )
                self._runner.release()
                if self._speculator is not None:
                    self._speculator.release()
        finally:
            if threads_before is not None:  # a caller training on this thread keeps its own share
                torch.set_num_threads(threads_before)
        self.stats.generate_calls += 1
        self.stats.generate_s += time.perf_counter() - started
        return results

    def _check_images(self, requests: Sequence[GenerationRequest]) -> None:
        if not any(r.image_inputs for r in requests):
            return
        if self._speculator is not None or isinstance(self._runner, DecoderRunner):
            what = "speculative decoding" if self._speculator is not None else "the fast decoder"
            raise RolloutError(f"HFEngine: {what} takes text prompts only; image prompts need runner='generic' "
                               "(the default for a vision-language model) and no speculation")

    def _room(self, index: int, request: GenerationRequest, prompt: list[int], sampling: SamplingParams) -> int:
        """How many tokens this request may generate; raises RolloutError for an unusable prompt."""
        where = f"request {index}" + (f" ({request.request_id})" if request.request_id else "")
        if not prompt:
            raise RolloutError(f"{where}: empty prompt (the engine needs at least one prompt token)")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise RolloutError(f"{where}: token ids must be in [0, {self.vocab_size}) for this model")
        limit = sampling.max_new_tokens
        if self.max_length is not None:
            limit = min(limit, self.max_length - len(prompt))
            if limit < 1:
                raise RolloutError(
                    f"{where}: a prompt of {len(prompt)} tokens leaves no room in the model's context of "
                    f"{self.max_length}"
                )
        return limit

    @staticmethod
    def _streams(
        count: int, sampling: SamplingParams, request_seeds: Sequence[int | None] | None
    ) -> list[tuple[int, int]]:
        if request_seeds is not None:
            if len(request_seeds) != count:
                raise RolloutError(f"request_seeds has {len(request_seeds)} entries for {count} requests")
            return [(unseeded() if s is None else s, 0) for s in request_seeds]
        seed = unseeded() if sampling.seed is None else sampling.seed
        return [(seed, slot) for slot in range(count)]

    def _chunks(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        # Similar lengths together waste less padding; a group (n rows of one prompt) is never split.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        per_chunk = max(1, self.max_batch_size // n)
        return [order[i : i + per_chunk] for i in range(0, len(order), per_chunk)]

    def _run_chunk(
        self, prompts: list[list[int]], limits: list[int], row_seeds: list[int], sampling: SamplingParams,
        image_inputs: list[dict[str, Any] | None] | None = None,
    ) -> list[tuple[list[int], list[float], str, str]]:
        row_limits = [limit for limit in limits for _ in range(sampling.n)]
        rows_per_prompt: int | list[int] = sampling.n
        order = None if self._speculator is not None else self._shared_prompts(prompts, sampling.n, image_inputs)
        if order is not None:  # rows grouped by prompt; put back in the requests' order at the end
            prompts, rows_per_prompt, order = order
            row_limits, row_seeds = [row_limits[r] for r in order], [row_seeds[r] for r in order]
        record = _Record(row_limits, StopRule(self.tokenizer, self.eos_ids, sampling, self.placeholder_ids))
        if self._speculator is not None:
            self._speculate(prompts, row_limits, row_seeds, sampling, record)
            return record.completions()
        steps = max(row_limits)
        if isinstance(self._runner, DecoderRunner):
            self._runner.kv_dtype = self._kv_dtype(prompts, len(row_limits), steps)
        if image_inputs and any(image_inputs):
            logits = self._runner.prefill(prompts, sampling.n, steps, image_inputs)
        else:
            logits = self._runner.prefill(prompts, rows_per_prompt, steps)
        self._note_kv_memory()
        sampler = Sampler(sampling, row_seeds, steps, self.device)
        batch: list[int | None] = list(range(len(row_limits)))  # batch position -> row, None once finished
        for step in range(steps):
            sampled, sampled_logprobs = sampler.sample(logits, step)
            batch = record.add(batch, sampled.tolist(), sampled_logprobs.tolist())
            alive = [position for position, row in enumerate(batch) if row is not None]
            if not alive:
                break
            if len(batch) - len(alive) >= max(1, len(batch) // 8):  # compact: drop the finished rows
                keep = torch.tensor(alive, device=self.device)
                self._runner.keep(keep)
                sampler.keep(keep)
                sampled = sampled[keep]
                batch = [batch[position] for position in alive]
            logits = self._runner.decode(sampled)
        self._note_kv_memory()  # the generic runner's cache grows as it decodes
        self._count(record)
        completions = record.completions()
        if order is not None:
            inverse = sorted(range(len(order)), key=order.__getitem__)  # position of each original row
            completions = [completions[position] for position in inverse]
        return completions

    def _shared_prompts(self, prompts: list[list[int]], n: int, image_inputs: list[dict[str, Any] | None] | None
                        ) -> tuple[list[list[int]], list[int], list[int]] | None:
        """With `share_prompts`, when some prompts of the chunk are the same: the distinct prompts, the rows each
        gets, and the original rows (request i's sample j is row i * n + j) in that order; else None."""
        if not self.share_prompts or not isinstance(self._runner, DecoderRunner) or any(image_inputs or []):
            return None
        rows: dict[tuple[int, ...], list[int]] = {}  # each distinct prompt's rows, in order of first appearance
        for index, prompt in enumerate(prompts):
            rows.setdefault(tuple(prompt), []).extend(range(index * n, (index + 1) * n))
        if len(rows) == len(prompts):
            return None
        return [list(prompt) for prompt in rows], [len(r) for r in rows.values()], [r for g in rows.values() for r in g]

    def _kv_dtype(self, prompts: list[list[int]], rows: int, steps: int) -> torch.dtype:
        """The KV storage dtype for a chunk: float32 (fastest to read) while the widened cache is small and the
        prompts short; the attention dtype (the model's, or autocast's) for long prompts or past
        `kv_widen_limit_mb`. Under fp32 the two are the same."""
        narrow = self._runner.dims.attn_dtype
        if self.kv_cache_dtype == "float32" or narrow == torch.float32:
            return torch.float32
        if self.kv_cache_dtype == "model":
            return narrow
        width = max(len(p) for p in prompts)
        dims = self._runner.dims
        columns = width * len(prompts) + steps * rows  # prompt part (shared by a group) and generated part
        widened = 2 * len(self._runner.layers) * columns * dims.kv_heads * dims.head_dim * 4
        return narrow if width >= LONG_PROMPT or widened > self.kv_widen_limit_mb * 2**20 else torch.float32

    def _note_kv_memory(self) -> None:
        runner = self._runner
        if isinstance(runner, DecoderRunner):
            self.stats.peak_kv_mb = max(self.stats.peak_kv_mb, runner.peak_kv_bytes / 2**20)
            self.stats.kv_cache_dtype = str(runner.kv_dtype).removeprefix("torch.")
        else:
            self.stats.peak_kv_mb = max(self.stats.peak_kv_mb, runner.kv_bytes() / 2**20)
            self.stats.kv_cache_dtype = self.stats.kv_cache_dtype or "model"

    def _speculate(self, prompts: list[list[int]], row_limits: list[int], row_seeds: list[int],
                   sampling: SamplingParams, record: _Record) -> None:
        rounds = self._speculator.run(prompts, sampling.n, row_limits, row_seeds, sampling, record)
        self.stats.speculative_rounds += rounds.rounds
        self.stats.draft_tokens += rounds.drafted
        self.stats.accepted_tokens += rounds.accepted
        self._count(record)

    def _count(self, record: _Record) -> None:
        self.stats.chunks += 1
        self.stats.sequences += len(record.limits)
        self.stats.completion_tokens += sum(len(t) for t in record.tokens)

    # ---- weights ----------------------------------------------------------------------------------------

    def update_weights(self, state: Mapping[str, Any], version: int) -> float:
        """Copy `state` into the model in place; later completions report `version`. Returns seconds taken.

        Waits for a running `generate` to finish. Names: see `posttrain.rollout.weights` (the model's own
        state-dict names, optionally behind ``module.``, ``_orig_mod.``, ``base_model.model.`` or PEFT's
        ``.base_layer``). A bad state raises RolloutError and changes nothing.
        """
        started = time.perf_counter()
        with self._lock:
            try:
                updates = check_state(self.model, state)
            except ValueError as error:
                raise RolloutError(f"update_weights(version={version}): {error}") from None
            written = copy_state(updates)
            self._version = version
        seconds = time.perf_counter() - started
        self.stats.weight_updates += 1
        self.stats.update_s += seconds
        self.stats.last_update_s = seconds
        log.info(
            "update_weights: version %d, %d tensors, %.1f MB in %.3f s", version, len(updates), written / 1e6, seconds
        )
        return seconds
