"""`VLLMEngine`: the same contract on vLLM, for GPUs. vLLM is imported lazily (``pip install 'posttrain[gpu]'``).

UNTESTED HERE: written against vLLM's documented offline API (``LLM``, ``SamplingParams``, ``collective_rpc``,
``worker_extension_cls``, ``logprobs_mode``, vLLM >= 0.10.2) without a GPU or vLLM to run it on; only its
pure helpers are unit-tested. See docs/rollout.md.

* Logprobs: the engine is built with ``logprobs_mode="processed_logprobs"`` and every request asks for the
  sampled token's logprob (``logprobs=0``). vLLM's processed logprobs are ``log_softmax`` of the logits after
  temperature *and after top-k/top-p*; without top-k/top-p that is exactly the `Completion` contract's
  ``log_softmax(logits / T)``. With top-k/top-p they are the truncated distribution's, so such sampling is
  refused unless the engine was built with ``allow_truncated_logprobs=True``.
* Stops: vLLM stops on eos, ``stop_token_ids`` and stop strings (asked to keep the stop string); the tokens
  kept and the text are then recomputed by the same `StopRule` as `HFEngine`, so both engines return the
  same token ids for the same samples.
* Seeds: a seeded request gets vLLM's per-request seed ``stream_seed(seed, slot, 0)``; its n samples come
  from that one stream (vLLM samples a group together), so seeded runs repeat, but completion j of a group
  is not the same as `HFEngine`'s.
* Weights: `update_weights` checks the state against the model's Hugging Face parameter names and shapes
  (built on the meta device from its config: no memory), then sends it to every worker through
  ``collective_rpc`` where `PosttrainWorkerExtension` calls the model's own ``load_weights`` (which maps
  Hugging Face names onto vLLM's fused layers), then resets the prefix cache so no KV computed with the old
  weights is reused. For multi-GPU or very large models, vLLM's native weight-transfer API (NCCL / CUDA IPC)
  is faster; it is not wired here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.rollout.errors import RolloutError
from posttrain.rollout.sampling import check_sampling, stream_seed
from posttrain.rollout.stopping import StopRule, eos_token_ids
from posttrain.rollout.weights import canonical_name, check_state
from posttrain.types import Completion, GenerationRequest, SamplingParams

log = logging.getLogger(__name__)

EXTENSION = "posttrain.rollout.vllm_worker.PosttrainWorkerExtension"


def _require_vllm() -> Any:
    try:
        import vllm
    except ImportError:
        raise RolloutError(
            "VLLMEngine needs vLLM, which is not installed: `pip install 'posttrain[gpu]'` on a machine with a "
            "CUDA GPU (vLLM >= 0.10.2), or use HFEngine (CPU or GPU, no extra dependency)"
        ) from None
    return vllm


def vllm_sampling_kwargs(sampling: SamplingParams, stop_token_ids: set[int], seed: int | None) -> dict[str, Any]:
    """The keyword arguments of ``vllm.SamplingParams`` for one request of this call."""
    return {
        "n": sampling.n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,  # -1 = off (older vLLM rejects 0)
        "max_tokens": sampling.max_new_tokens,
        "stop": list(sampling.stop),
        "stop_token_ids": sorted(stop_token_ids),
        "include_stop_str_in_output": True,  # the cut is ours (StopRule), on token boundaries
        "logprobs": 0,  # the sampled token's logprob only
        "seed": seed,
        "skip_special_tokens": True,
    }


def completion_from_vllm(output: Any, rule: StopRule, version: int, request_id: str) -> Completion:
    """One vLLM ``CompletionOutput`` as a `Completion`, cut by `rule` like `HFEngine` cuts."""
    token_ids = list(output.token_ids)
    if output.logprobs is None:
        raise RolloutError("vLLM returned no logprobs (was the request built with logprobs=0?)")
    logprobs = [float(step[token].logprob) for step, token in zip(output.logprobs, token_ids)]
    if output.finish_reason == "length":
        kind = "length"
    elif isinstance(getattr(output, "stop_reason", None), str):
        kind = "string"
    else:
        kind = "token"  # eos (stop_reason None) or a stop token id
    ids, lps, text = rule.cut(token_ids, logprobs, kind)
    return Completion(ids, text, lps, "length" if kind == "length" else "stop", version, request_id)


class VLLMEngine:
    """`InferenceEngine` on vLLM (GPU). ``model`` is a local Hugging Face directory; ``llm_kwargs`` go to
    ``vllm.LLM`` (e.g. ``gpu_memory_utilization``, ``dtype``, ``max_model_len``)."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer: Any = None,
        policy_version: int = 0,
        allow_truncated_logprobs: bool = False,
        **llm_kwargs: Any,
    ):
        vllm = _require_vllm()
        self._vllm = vllm
        llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        llm_kwargs.setdefault("worker_extension_cls", EXTENSION)
        self.llm = vllm.LLM(model=model, **llm_kwargs)
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        self.allow_truncated_logprobs = allow_truncated_logprobs
        self._reference = _meta_model(model)
        self.eos_ids = eos_token_ids(self.tokenizer, self._reference)
        self._version = policy_version
        self._lock = threading.Lock()
        self.last_update_s: float | None = None

    @property
    def policy_version(self) -> int:
        return self._version

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        sampling: SamplingParams,
        *,
        request_seeds: Sequence[int | None] | None = None,
    ) -> list[list[Completion]]:
        check_sampling(sampling)
        if any(r.image_inputs for r in requests):  # never drop an image silently
            raise RolloutError("VLLMEngine: image prompts are not supported yet (docs/multimodal.md); sample them "
                               "with the built-in engine (posttrain.rl.image_engine)")
        truncated = (sampling.top_k > 0 or sampling.top_p < 1) and sampling.temperature > 0
        if truncated and not self.allow_truncated_logprobs:
            raise RolloutError(
                "VLLMEngine: with top_k/top_p vLLM reports the truncated distribution's logprobs, not the "
                "contract's log_softmax(logits / T); use top_k=0, top_p=1, or build the engine with "
                "allow_truncated_logprobs=True"
            )
        if request_seeds is not None and len(request_seeds) != len(requests):
            raise RolloutError(f"request_seeds has {len(request_seeds)} entries for {len(requests)} requests")
        rule = StopRule(self.tokenizer, self.eos_ids, sampling)
        params = []
        for slot in range(len(requests)):
            if request_seeds is not None:
                seed = request_seeds[slot]
                seed = stream_seed(seed, 0, 0) if seed is not None else None
            else:
                seed = stream_seed(sampling.seed, slot, 0) if sampling.seed is not None else None
            params.append(self._vllm.SamplingParams(**vllm_sampling_kwargs(sampling, rule.stop_ids, seed)))
        prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
        with self._lock:
            version = self._version
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [
            [completion_from_vllm(o, rule, version, r.request_id) for o in out.outputs]
            for r, out in zip(requests, outputs)
        ]

    def update_weights(self, state: Mapping[str, Any], version: int) -> float:
        """Check `state`, load it into every vLLM worker in place, reset the prefix cache; returns seconds."""
        started = time.perf_counter()
        try:
            check_state(self._reference, state)
        except ValueError as error:
            raise RolloutError(f"update_weights(version={version}): {error}") from None
        named = [(canonical_name(name), tensor.detach()) for name, tensor in state.items()]
        with self._lock:
            missing = self.llm.collective_rpc("posttrain_load_weights", args=(named,))
            if any(missing):
                raise RolloutError(
                    f"update_weights(version={version}): vLLM did not load {sorted(set().union(*missing))[:5]}; "
                    "the engine's weights may now be mixed, push a complete state again"
                )
            if hasattr(self.llm, "reset_prefix_cache"):
                self.llm.reset_prefix_cache()
            self._version = version
        self.last_update_s = time.perf_counter() - started
        log.info("VLLMEngine.update_weights: version %d in %.3f s", version, self.last_update_s)
        return self.last_update_s


def _meta_model(path: str) -> Any:
    """The Hugging Face model at `path` with no storage (meta device): its parameter names and shapes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
