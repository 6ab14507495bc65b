"""Inference engines behind one contract (`posttrain.types.InferenceEngine`), and an asyncio front for them.

    from posttrain.rollout import HFEngine, AsyncBatcher, state_for_engine

    engine = HFEngine(model, tokenizer, autocast="bfloat16")
    groups = engine.generate([GenerationRequest(prompt_ids)], SamplingParams(n=8, max_new_tokens=64))
    engine.update_weights(state_for_engine(trainer_model), version=step)

`HFEngine` runs any Hugging Face causal LM (CPU or CUDA); `VLLMEngine` runs vLLM on GPUs (imported lazily);
`AsyncBatcher` gathers the generate calls of many concurrent episodes into engine batches;
`ContinuousBatcher` lets requests join and leave a running batch at every decode step (the server's loop);
`Speculation` (``HFEngine(..., speculative=...)``) turns on speculative decoding with a draft model or prompt
lookup (`load_speculation` reads the config form: ``"ngram"``, a preset or a model directory). docs/rollout.md
has the exact token rules at stops, the logprob convention and measured throughput.
"""

from posttrain.rollout.batcher import AsyncBatcher
from posttrain.rollout.continuous import ContinuousBatcher, SequenceEvent, StreamRequest, check_request, check_room
from posttrain.rollout.engine import EngineStats, HFEngine
from posttrain.rollout.errors import RolloutError
from posttrain.rollout.speculative import Speculation, check_same_tokenizer, load_speculation
from posttrain.rollout.stopping import eos_token_ids
from posttrain.rollout.vllm_engine import VLLMEngine
from posttrain.rollout.weights import canonical_name, state_for_engine

__all__ = [
    "AsyncBatcher",
    "ContinuousBatcher",
    "EngineStats",
    "HFEngine",
    "RolloutError",
    "SequenceEvent",
    "Speculation",
    "StreamRequest",
    "VLLMEngine",
    "canonical_name",
    "check_request",
    "check_room",
    "check_same_tokenizer",
    "eos_token_ids",
    "load_speculation",
    "state_for_engine",
]
