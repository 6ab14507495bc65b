"""Context extension by rotary-embedding scaling (`model.rope_scaling`), for any model transformers builds a
rotary embedding for from ``config.rope_parameters``.

Rotary position embedding rotates channel pair i of a query/key at position p by the angle ``p * theta_i``
with ``theta_i = base^(-2i/d)``. Past the trained length the model meets angles it never saw; the scalings
map long positions back into the trained range (formulas as transformers implements them,
`transformers.modeling_rope_utils`):

* linear (position interpolation, Chen et al. 2023): ``theta_i / factor`` for every i;
* dynamic (NTK-aware, bloc97/emozilla): the base becomes ``base * (factor * L / L0 - (factor - 1))^(d/(d-2))``
  for a sequence of length ``L > L0``: unchanged up to the original length, it depends on the sequence
  length, so a KV cache written at one length does not match a forward at another (see the decoder);
* yarn (Peng et al. 2023): high-frequency pairs (more than `beta_fast` rotations over ``L0``) kept, low
  ones (fewer than `beta_slow`) divided by `factor`, a linear ramp between; cos/sin scaled by the attention
  temperature ``0.1 ln(factor) + 1``;
* llama3 (Llama 3.1): wavelengths shorter than ``L0 / high_freq_factor`` kept, longer than
  ``L0 / low_freq_factor`` divided by `factor`, a smooth blend between.

`apply_rope_scaling` writes the scaling into a Hugging Face config before the model is built, so the saved
checkpoint carries it (and the new ``max_position_embeddings``) and plain transformers reloads the same
function. Hugging Face's dynamic scaling reads ``max_position_embeddings`` as the *original* length, so for
"dynamic" that field is left alone and the extended length is recorded as ``posttrain_context_length``;
`context_length` reads either.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from posttrain.config import RopeScalingConfig
from posttrain.types import PosttrainError

log = logging.getLogger(__name__)

EXTENDED_LENGTH_KEY = "posttrain_context_length"


class RopeScalingError(PosttrainError):
    """`model.rope_scaling` cannot be applied to this model."""


def rope_parameters(scaling: RopeScalingConfig, original_length: int, base: dict[str, Any]) -> dict[str, Any]:
    """transformers' ``rope_parameters`` dict for `scaling` on a model trained to `original_length`, keeping
    the model's own ``rope_theta`` and ``partial_rotary_factor`` (from `base`)."""
    params = {key: base[key] for key in ("rope_theta", "partial_rotary_factor") if key in base}
    params.update(rope_type=scaling.type, factor=float(scaling.factor))
    if scaling.type in ("yarn", "llama3"):
        params["original_max_position_embeddings"] = original_length
    if scaling.type == "yarn":
        params.update(beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow)
        if scaling.attention_factor is not None:
            params["attention_factor"] = scaling.attention_factor
    if scaling.type == "llama3":
        params.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor)
    return params


def apply_rope_scaling(config: Any, scaling: RopeScalingConfig | None) -> Any:
    """Write `scaling` into the Hugging Face `config` (in place; returned) before the model is built from it.

    A config that already carries exactly this scaling (a checkpoint saved by an extended run) is left as it
    is; one with another non-default rotary scaling is a `RopeScalingError` (stacking two scalings is not a
    scaling transformers can express)."""
    if scaling is None:
        return config
    current = getattr(config, "rope_parameters", None)
    if not isinstance(current, dict) or "rope_theta" not in current:
        raise RopeScalingError(
            f"model.rope_scaling: {type(config).__name__} has no single rotary embedding to scale "
            "(no rope_parameters with a rope_theta); remove model.rope_scaling for this model"
        )
    current_type = current.get("rope_type", "default")
    if current_type != "default":
        if _already_applied(config, current, scaling):
            return config
        raise RopeScalingError(
            f"model.rope_scaling: the model already uses rope type {current_type!r} "
            f"(factor {current.get('factor')}); extend a model with default rotary embeddings, or drop "
            "model.rope_scaling to keep the model's own scaling"
        )
    original = scaling.original_max_position_embeddings or int(config.max_position_embeddings)
    extended = int(math.floor(original * scaling.factor))
    config.rope_parameters = rope_parameters(scaling, original, current)
    if scaling.type == "dynamic":
        config.max_position_embeddings = original  # transformers' dynamic scaling starts past this length
        setattr(config, EXTENDED_LENGTH_KEY, extended)
    else:
        config.max_position_embeddings = extended
    log.info("rope scaling %s x%g: context %d -> %d positions", scaling.type, scaling.factor, original, extended)
    return config


def _already_applied(config: Any, current: dict[str, Any], scaling: RopeScalingConfig) -> bool:
    if current.get("rope_type") != scaling.type or float(current.get("factor", 0)) != float(scaling.factor):
        return False
    if scaling.original_max_position_embeddings is None:
        return True
    original = current.get("original_max_position_embeddings", config.max_position_embeddings)
    return int(original) == scaling.original_max_position_embeddings


def context_length(config: Any) -> int | None:
    """The longest sequence the model is configured for: the extended length under dynamic scaling, else
    ``max_position_embeddings`` (``n_positions`` for GPT-2-style configs)."""
    extended = getattr(config, EXTENDED_LENGTH_KEY, None)
    if extended:
        return int(extended)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
