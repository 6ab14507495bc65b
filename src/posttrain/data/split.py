"""Held-out split by a stable hash of the prompt, so a prompt is always on one side only.

A sample goes to the held-out side when ``sha256(salt + "\\x1f" + prompt_text)``, read as a number in [0, 1),
is below `fraction`. The hash does not depend on the order of the samples, the process or the machine, so the
same prompt lands on the same side in every run and every epoch, and two samples sharing a prompt (say, two
answers to one question) never straddle the split.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

from posttrain.data.schema import SFTSample

HELDOUT_SALT = "posttrain-heldout"


def prompt_fraction(prompt: str, salt: str = HELDOUT_SALT) -> float:
    """Where `prompt` falls in [0, 1): the held-out side is everything below the fraction."""
    digest = hashlib.sha256(f"{salt}\x1f{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_by_hash(
    samples: Sequence[SFTSample], fraction: float, salt: str = HELDOUT_SALT
) -> tuple[list[SFTSample], list[SFTSample]]:
    """Return ``(train, heldout)``; about `fraction` of the distinct prompts go to held-out."""
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    train, heldout = [], []
    for sample in samples:
        side = heldout if prompt_fraction(sample.prompt_text, salt) < fraction else train
        side.append(sample)
    return train, heldout
