"""The start-up self-test: do the engine and the trainer agree on what the policy is?

Before the first step the trainer pushes its weights to the engine, samples a fixed batch, re-scores those
exact tokens with its own forward pass and compares log-probs. A gap beyond the tolerance means the two are
not running the same policy — weights that never reached the engine, a LoRA adapter left out of the pushed
weights, a different chat template or tokenizer, a numeric path far off — and the run stops before it
trains on garbage. The same comparison is logged every step (`gap_*` metrics) from the training forward.

The default tolerance follows the precision in use (`train.forward.logprob_tolerance`): 1e-3 in fp32; in bf16
a few bf16 epsilons per unit of the largest |logit|, from the noise measured between two bf16 forwards of the
same model — not a flat allowance that would also pass a different function (a missing soft-cap).
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.data import prompt_ids
from posttrain.train import Runtime, logprob_gap_stats, logprob_tolerance, selected_logits, target_logprobs
from posttrain.types import GenerationRequest, PosttrainError, SamplingParams, Task

class SelfTestError(PosttrainError):
    """The engine and the trainer disagree about the policy's log-probs."""


@torch.no_grad()
def engine_trainer_self_test(
    engine: Any,
    model: torch.nn.Module,
    tokenizer: Any,
    tasks: list[Task],
    runtime: Runtime,
    *,
    temperature: float,
    max_new_tokens: int,
    tolerance: float | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Sample `tasks` with the engine, re-score with the trainer; raise `SelfTestError` past `tolerance`."""
    prompts = prompt_ids(tokenizer, [task.messages for task in tasks])
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    completions = engine.generate([GenerationRequest(p) for p in prompts], sampling)
    trainer, behaviour, top = [], [], 0.0
    was_training = model.training
    model.eval()
    for prompt, (completion,) in zip(prompts, completions):
        if not completion.token_ids:
            continue
        ids = torch.tensor([prompt + completion.token_ids], device=runtime.device)
        select = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool, device=runtime.device)
        select[0, len(prompt) - 1 :] = True
        with runtime.autocast():
            logits = selected_logits(model, ids, select)
        top = max(top, float(logits.abs().max()))
        trainer.append(target_logprobs(logits, ids[0, len(prompt):], temperature if temperature > 0 else 1.0))
        behaviour.append(torch.tensor(completion.logprobs, device=runtime.device))
    model.train(was_training)
    if not trainer:
        raise SelfTestError("self-test: the engine returned no tokens for the test prompts")
    stats = logprob_gap_stats(torch.cat(trainer).float(), torch.cat(behaviour).float())
    tolerance = tolerance if tolerance is not None else logprob_tolerance(runtime.autocast_dtype, top)
    if stats["gap_abs_max"] > tolerance:
        raise SelfTestError(
            f"self-test: engine and trainer log-probs differ by up to {stats['gap_abs_max']:.4g} "
            f"(mean {stats['gap_abs_mean']:.3g}, tolerance {tolerance:.3g}): the engine is not running the trainer's "
            "policy (weights not pushed? adapter missing? a different tokenizer or chat template?). "
            "Set pipeline.self_test_tolerance to accept a larger numeric gap."
        )
    return stats
