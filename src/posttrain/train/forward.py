"""Forward passes that compute the output head only where a loss needs it.

A causal LM's head (hidden -> vocabulary) is the largest matmul of a small model with a real vocabulary,
and SFT/RL only score a fraction of the positions (assistant tokens, sampled tokens). So we run the
decoder once over the whole sequence and apply the head to the selected positions only. Logits are
upcast to fp32 before any softmax: bf16 logits lose the small differences that log-probabilities live in.

Whatever the model's own forward does after its head is done here too: the final-logit soft-cap
(Gemma 2/3: ``logits = cap * tanh(logits / cap)``, in fp32 here). A model that rescales its logits in a way
this module does not know (Cohere's ``logit_scale``, Granite's ``logits_scaling``) is not split: it runs its
own whole forward, slower but the same function; so does a vision-language model (its decoder is the language model
alone, which would drop the image). `check_forward_parity` compares this
forward with the model's at the start of a run (below).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Literal, Sequence

import torch

from posttrain.data import Row, collate, model_inputs
from posttrain.models import multimodal_token_types, split_head
from posttrain.types import PosttrainError

log = logging.getLogger(__name__)


def selected_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    select: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **model_kwargs: Any,
) -> torch.Tensor:
    """fp32 logits predicting token t+1 from position t, for every (b, t) where `select[b, t]` ([B, T-1]).

    Returns [N, vocab] in the row-major order of `select`'s True entries. `model_kwargs` go to the decoder
    (e.g. the `cu_seq_lens_*` of a packed batch for variable-length attention).
    """
    parts = _splittable(model)
    model_kwargs.setdefault("use_cache", False)  # a KV cache would stop transformers keeping packed samples apart
    if parts is None:
        if "image_grid_thw" in model_kwargs and "mm_token_type_ids" not in model_kwargs:
            # Qwen2-VL places its 3-D rotary positions by the token types its processor made from these same ids
            types = multimodal_token_types(model, input_ids)
            model_kwargs = model_kwargs if types is None else {**model_kwargs, "mm_token_type_ids": types}
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       **model_kwargs).logits
        return logits[:, :-1][select].float()
    decoder, head = parts
    hidden = decoder_hidden(decoder, input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            **model_kwargs)
    return _after_head(model, head(hidden[:, :-1][select]).float())


def decoder_hidden(decoder: torch.nn.Module, input_ids: torch.Tensor, **model_kwargs: Any) -> torch.Tensor:
    """The decoder stack's last hidden states [B, T, H] (`_single_row_eagerly` when it is compiled)."""
    with _single_row_eagerly(decoder, input_ids.size(0)):
        return decoder(input_ids=input_ids, **model_kwargs).last_hidden_state


def _single_row_eagerly(decoder: torch.nn.Module, rows: int):
    """A compiled decoder first called on batches of several rows runs a batch of one row eagerly.

    torch specializes sizes 0 and 1, so a single row would cost a graph of its own (a recompile: 13.5 CPU-s with
    a cold cache, ~1.5 warm, tiny-3m on a 2-core machine, docs/benchmarks.md) for batches that are rare in such
    a run: RL's mini-batch whose every sequence has zero advantage runs its shortest one, a micro-batch split
    leaves one sequence over. A decoder whose first
    call had one row (packed SFT rows with `micro_batch_size: 1`) keeps compiling them: that is its graph."""
    if getattr(decoder, "_compiled_call_impl", None) is None:
        return contextlib.nullcontext()
    first = getattr(decoder, "_posttrain_first_rows", None)
    if first is None:
        decoder._posttrain_first_rows = first = rows
    return torch.compiler.set_stance("force_eager") if rows == 1 and first > 1 else contextlib.nullcontext()


# Logit rescalings some families apply after the head that `selected_logits` does not reproduce.
_UNKNOWN_HEAD_SCALINGS = ("logit_scale", "logits_scaling")


def _splittable(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is not None:
        # A vision-language model's `get_decoder` is its language model, which never sees the image (the vision
        # tower and the projector merge the image features in the outer model's forward), and it ignores
        # `pixel_values` passed to it: run the whole model.
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _UNKNOWN_HEAD_SCALINGS):
        return None
    return split_head(model)


def final_logit_softcap(model: torch.nn.Module) -> float | None:
    """The model's final-logit soft-cap (Gemma 2/3), or None."""
    return getattr(getattr(model, "config", None), "final_logit_softcapping", None) or None


def _after_head(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    cap = final_logit_softcap(model)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(target) under log_softmax(logits / temperature), computed without materialising log_softmax."""
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


# ----------------------------------------------------------------------------------------------------
# Tolerance by precision, and the start-up parity check
# ----------------------------------------------------------------------------------------------------

FP32_LOGPROB_TOLERANCE = 1e-3
# Two bf16 forwards of the same model (trainer vs engine, ours vs the model's) differed in log-probs by at
# most ~2.1 bf16 epsilons (2^-8) times the largest |logit| on nine tiny families (tests/test_conformance.py,
# measured on a CPU): rounding a logit moves it by up to eps * |logit|. Four epsilons per unit of logit is
# about twice that; a function that differs (a missing soft-cap, a window dropped) moves log-probs by
# far more on any model whose logits are large enough for the difference to matter.
BF16_NOISE_PER_LOGIT = 4 * 2.0**-8


def logprob_tolerance(autocast: torch.dtype | None, max_abs_logit: float) -> float:
    """How far two log-probs of the same function may differ at this precision: 1e-3 in fp32 (they agree to
    ~1e-5); in bf16, `BF16_NOISE_PER_LOGIT` times the largest |logit| (at least 1)."""
    if autocast is None or autocast == torch.float32:
        return FP32_LOGPROB_TOLERANCE
    return max(FP32_LOGPROB_TOLERANCE, BF16_NOISE_PER_LOGIT * max(1.0, max_abs_logit))


class ForwardParityError(PosttrainError):
    """posttrain's training forward and the model's own forward compute different functions."""


Layout = Literal["packed", "padded"]  # "packed" (SFT rows, samples side by side) or "padded" (DPO/RM right-padded rows, no mask)


@torch.no_grad()
def check_forward_parity(
    model: torch.nn.Module,
    samples: Sequence[Any],
    autocast: torch.dtype | None,
    *,
    layout: Layout,
    what: str = "training",
    max_samples: int = 8,
) -> dict[str, float]:
    """Compare the training forward on one batch with the model's own (transformers, eager attention, each
    sample alone, unpadded); raise `ForwardParityError` past `logprob_tolerance`. Returns the gap stats.

    `samples`: token-id lists, packed rows with ``input_ids`` and ``document_ids`` (`posttrain.data.Row`,
    split into their samples) or tokenized preference pairs (both sequences); the first `max_samples`
    sequences are used. `layout` is how the recipe
    feeds them: "packed" (one row, `cu_seq_lens` boundaries, as SFT collates) or "padded" (right-padded
    rows without a mask, as DPO and the reward model collate). Cheap: one forward per sample and one batch.
    """
    sequences = _split_samples(samples, max_samples)
    if not sequences:
        return {}
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        ours = _layout_logprobs(model, sequences, layout, device, autocast)
        reference, top = _reference_logprobs(model, sequences, device, autocast)
    finally:
        model.train(was_training)
    gap = (ours - reference).abs()
    stats = {"parity_gap_max": float(gap.max()), "parity_gap_mean": float(gap.mean()),
             "parity_tolerance": logprob_tolerance(autocast, top)}
    if stats["parity_gap_max"] > stats["parity_tolerance"]:
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", "?")
        raise ForwardParityError(
            f"{what} forward parity: posttrain's forward ({layout} rows, attention {implementation!r}) and the "
            f"model's own forward differ in log-probs by up to {stats['parity_gap_max']:.4g} (tolerance "
            f"{stats['parity_tolerance']:.3g}): training would optimise a different function. Set "
            "model.attn_implementation to 'eager', and report the model type"
        )
    log.info("%s forward parity: max log-prob gap %.3g (tolerance %.3g)", what, stats["parity_gap_max"],
             stats["parity_tolerance"])
    return stats


def _split_samples(samples: Sequence[Any], limit: int) -> list[list[int]]:
    """Up to `limit` token sequences (of 2 tokens or more: one has nothing to predict) from `samples`."""
    out: list[list[int]] = []
    for sample in samples[:limit]:  # a slice: a streaming epoch is read by forward slices, never by index
        if len(out) >= limit:
            break
        if hasattr(sample, "chosen_ids"):  # a tokenized preference pair: both of its sequences
            out += [list(sample.chosen_ids), list(sample.rejected_ids)]
            continue
        ids = list(getattr(sample, "input_ids", sample))
        documents = getattr(sample, "document_ids", None)
        if documents is None:
            out.append(ids)
            continue
        start = 0
        for end in range(1, len(ids) + 1):
            if end == len(ids) or documents[end] != documents[start]:
                if documents[start] >= 0:
                    out.append(ids[start:end])
                start = end
    return [sequence for sequence in out if len(sequence) > 1][:limit]


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def _layout_logprobs(model, sequences, layout, device, autocast) -> torch.Tensor:
    if layout == "packed":
        row = Row([], [], [], [])
        for index, sequence in enumerate(sequences):
            row.input_ids += sequence
            row.loss_mask += [1] * len(sequence)
            row.position_ids += list(range(len(sequence)))
            row.document_ids += [index] * len(sequence)
        inputs = model_inputs(collate([row], pad_id=0, device=device))
        labels = inputs.pop("labels")
        select = labels[:, 1:] != -100
        with _autocast(device, autocast):
            logits = selected_logits(model, inputs.pop("input_ids"), select, **inputs)
        return target_logprobs(logits, labels[:, 1:][select])
    if layout != "padded":
        raise ValueError(f"check_forward_parity: layout {layout!r}; use 'packed' or 'padded'")
    width = max(map(len, sequences))
    ids = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
    select = torch.zeros(len(sequences), width - 1, dtype=torch.bool, device=device)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence, device=device)
        select[row, : len(sequence) - 1] = True
    with _autocast(device, autocast):
        logits = selected_logits(model, ids, select)
    return target_logprobs(logits, ids[:, 1:][select])


def _reference_logprobs(model, sequences, device, autocast) -> tuple[torch.Tensor, float]:
    """The model's own forward (its own head and logit processing), eager attention, one sample at a time;
    and the largest |logit| seen (what bf16 noise scales with)."""
    config = model.config
    before = config._attn_implementation
    compiled = any(getattr(module, "_compiled_call_impl", None) is not None for module in model.modules())
    # A compiled decoder runs uncompiled here: eager attention would otherwise cost a recompilation.
    uncompiled = torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext()
    try:
        config._attn_implementation = "eager"
        with uncompiled, _autocast(device, autocast):
            out, top = [], 0.0
            for sequence in sequences:
                ids = torch.tensor([sequence], device=device)
                logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
                top = max(top, float(logits.abs().max()))
                out.append(target_logprobs(logits, ids[0, 1:]))
    finally:
        config._attn_implementation = before
    return torch.cat(out), top
