"""When a sequence stops, and exactly which tokens a finished completion keeps.

A completion's ``text`` is always exactly ``tokenizer.decode(token_ids, skip_special_tokens=True)``, so what
a verifier reads and what the trainer scores never disagree. The rules, per finish:

* stop token (the tokenizer's / model's eos, or one of ``stop_token_ids``): the stop token is the last
  token of ``token_ids`` (with its logprob) when ``include_stop_in_output`` (the default: the trainer learns
  to stop); without it, the completion ends just before it.
* stop string (checked on the decoded text after every token): with ``include_stop_in_output``, the
  completion keeps every token up to and including the token that completed the (earliest) stop string —
  so ``text`` ends with the stop string, plus whatever else that last token carries (a stop ``"\\n"``
  completed by a token ``"\\n\\n"`` keeps both newlines). Without it, the completion keeps the longest run of
  tokens whose text ends at or before the start of the stop string: a token straddling the boundary is
  dropped with everything after it.
* length (``max_new_tokens``, or the model's context): everything sampled is kept.
* image placeholder (a vision-language model's image or video token, `models.image_placeholder_ids`): the row
  ends just before it, finish "stop". The token only marks where a processor puts an image's features; sampled
  into a reply it would be scored by the trainer's forward as a slot for an image that is not there (transformers
  refuses the count), so it never enters a completion.

Stop strings are matched on text with special tokens skipped (like vLLM); to stop on a special token, put
its id in ``stop_token_ids``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from posttrain.types import SamplingParams


def eos_token_ids(tokenizer: Any, model: Any = None) -> set[int]:
    """Every id the tokenizer or the model's generation config calls end-of-sequence."""
    ids: set[int] = set()
    candidates = [getattr(tokenizer, "eos_token_id", None)]
    for config in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        candidates.append(getattr(config, "eos_token_id", None))
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


class StopRule:
    """The stop tokens and stop strings of one generate call, and the cut they imply."""

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int], sampling: SamplingParams,
                 placeholder_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(eos_ids) | frozenset(sampling.stop_token_ids)
        self.placeholder_ids = frozenset(placeholder_ids)
        self.strings = list(sampling.stop)
        self.include = sampling.include_stop_in_output
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
        # A stop string ending in the newest token starts at most this many (non-empty) tokens earlier;
        # one more token of context keeps a tokenizer that strips a leading space from matching short.
        self.lookback = max((len(s.encode()) for s in self.strings), default=0)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _tail(self, token_ids: list[int]) -> list[int]:
        start, needed = len(token_ids) - 1, self.lookback
        while start > 0 and needed > 0:
            start -= 1
            if token_ids[start] not in self.special_ids:
                needed -= 1
        return token_ids[start:]

    def string_hits(self, sequences: list[list[int]]) -> list[bool]:
        """For each sequence, whether its decoded text now contains a stop string (checked on its tail)."""
        if not self.strings or not sequences:
            return [False] * len(sequences)
        texts = self.tokenizer.batch_decode([self._tail(s) for s in sequences], skip_special_tokens=True)
        return [any(stop in text for stop in self.strings) for text in texts]

    def cut(self, token_ids: list[int], logprobs: list[float], reason: str) -> tuple[list[int], list[float], str]:
        """Apply the rules above; `reason` is "token", "string", "placeholder" or "length". Returns ids, logprobs,
        text."""
        if reason == "placeholder" or (reason == "token" and not self.include):
            token_ids, logprobs = token_ids[:-1], logprobs[:-1]
        elif reason == "string" and not self.include:
            text = self.decode(token_ids)
            start = min(i for i in (text.find(s) for s in self.strings) if i >= 0)
            keep = len(token_ids) - 1
            while keep > 0:
                prefix = self.decode(token_ids[:keep])
                if len(prefix) <= start and text.startswith(prefix):
                    break
                keep -= 1
            token_ids, logprobs = token_ids[:keep], logprobs[:keep]
        return token_ids, logprobs, self.decode(token_ids)
