"""Needle in a haystack: find one or several facts ("The secret code of Varnholt is 482913.") in long filler text.

The haystack is digit-free filler (`posttrain.tasks.haystack`); `needles` facts are placed in it, the first at
a depth drawn from `depths` (a fraction of the document's tokens: 0 = the start, 1 = the end) and the others
spread evenly over the rest of the document after it (the multi-needle layout of LangChain's multi-needle test),
and `distractors` more codes of *other* names are scattered at random, so copying the only number in the text
does not pass. The question names the needles' keys; the answer is their codes in that order, comma-separated,
judged by the ``exact`` verifier (the whole completion, whitespace and case normalized).

Difficulty = length: level L fills the prompt (document and question) to ``lengths[L - 1]`` tokens, less
`reserve_tokens` for the chat markup and the answer (default 16 + 8 per needle), so a model with
`lengths[L - 1]` positions holds the whole episode. Defaults: 256 to 32,768 tokens over 8 levels; depths 0, 0.25,
0.5, 0.75, 1. Lengths are in the tokens of `tokenizer` when one is given (a directory, or a tokenizer object), else
estimated (see `haystack`).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Sequence

from posttrain.data import SFTSample
from posttrain.tasks.base import TaskError, demo_sample, domain, task_id
from posttrain.tasks.haystack import (Filler, TokenCounter, check_depths, check_lengths, fit_to_budget,
                                      level_length)
from posttrain.types import Task

DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
_ONSETS = ["Var", "Kel", "Dor", "Mir", "Tal", "Bren", "Sol", "Ash", "Cor", "Fen", "Hal", "Lin", "Mor", "Pel", "Ros",
           "Tor", "Ul", "Wen", "Yar", "Zel"]
_CODAS = ["holt", "mere", "wick", "dale", "ford", "stead", "bury", "moor", "gate", "field", "haven", "crest"]


def place_names(rng: random.Random, count: int) -> list[str]:
    """`count` distinct made-up place names (240 exist)."""
    return rng.sample([onset + coda for onset in _ONSETS for coda in _CODAS], count)


@domain("needle")
class NeedleHaystack:
    name = "needle"

    def __init__(self, lengths: Sequence[int] = DEFAULT_LENGTHS, depths: Sequence[float] = DEFAULT_DEPTHS,
                 needles: int = 1, distractors: int = 2, tokenizer: Any = None, chars_per_token: float = 4.0,
                 reserve_tokens: int | None = None, system_prompt: str | None = None):
        self.lengths = check_lengths(lengths, self.name)
        self.depths = check_depths(depths, self.name)
        if not 1 <= needles <= 8 or not 0 <= distractors <= 32:
            raise TaskError(f"needle: needles must be 1..8 and distractors 0..32, got {needles} and {distractors}")
        self.max_level = len(self.lengths)
        self.needles, self.distractors = needles, distractors
        self.counter = TokenCounter(tokenizer, chars_per_token)
        self.filler = Filler(self.counter)
        # Chat markup and the answer (a 6-digit code and its separator is about 8 tokens in most tokenizers).
        self.reserve_tokens = 16 + 8 * needles if reserve_tokens is None else reserve_tokens
        self.system_prompt = system_prompt

    def make_task(self, rng: random.Random, level: int) -> Task:
        length = level_length(self.lengths, level, self.name)
        names = place_names(rng, self.needles + self.distractors)
        codes = [str(rng.randint(100000, 999999)) for _ in names]
        facts = [f" The secret code of {name} is {code}." for name, code in zip(names, codes)]
        keys = names[: self.needles]
        question = self._question(keys)
        fixed = self.counter.counts(facts + [question])
        budget = length - self.reserve_tokens
        filler_budget = budget - sum(fixed)
        if filler_budget < 0:
            raise TaskError(f"needle: level {level} ({length} tokens) cannot hold {self.needles} needles and "
                            f"{self.distractors} distractors; raise its length or lower reserve_tokens")
        picks = self.filler.draw(rng, filler_budget - 4)  # room for the first piece, counted without its space
        pieces = [" " + self.filler.sentences[i] for i in picks]
        counts = [self.filler.tokens[i] for i in picks]
        offsets = _prefix_sums(counts)
        depth = rng.choice(self.depths)
        # Needle slots: the first at `depth`, the rest evenly over what follows; distractors anywhere else.
        slots = [depth + (1.0 - depth) * k / self.needles for k in range(self.needles)]
        positions = [_position_at(offsets, slot) for slot in slots]
        taken = set(positions)
        free = [p for p in range(len(pieces) + 1) if p not in taken] or [len(pieces)]
        positions += [rng.choice(free) for _ in range(self.distractors)]
        # Insert from the back so earlier positions stay valid; a needle before a distractor at the same place.
        for i in sorted(range(len(facts)), key=lambda i: (positions[i], -i), reverse=True):
            pieces.insert(positions[i], facts[i])
            counts.insert(positions[i], fixed[i])
        protected = {i for i, piece in enumerate(pieces) if piece in facts}
        pieces[0] = pieces[0].lstrip()  # the document starts without a space; so its first piece is counted
        counts[0] = self.counter.count(pieces[0])
        document, tokens = fit_to_budget(lambda ps: "".join(ps) + question, pieces, protected, self.counter,
                                         budget, sum(counts) + fixed[-1])
        needle_depths = [_depth_of(document, facts[i]) for i in range(self.needles)]
        messages = [{"role": "user", "content": document}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        answer = ", ".join(codes[: self.needles])
        key = hashlib.sha1(document.encode()).hexdigest()
        return Task(
            id=task_id(self.name, key), domain=self.name, difficulty=level, messages=messages,
            verifier="exact", verifier_args={"answer": answer}, max_steps=1, timeout_s=60.0,
            metadata={"problem_key": key, "answer": answer, "length": length, "context_tokens": tokens,
                      "tokens_exact": self.counter.exact, "depth": round(depth, 4),
                      "needle_depths": needle_depths, "needles": self.needles, "keys": keys},
        )

    def demonstration(self, task: Task) -> SFTSample:
        return demo_sample(task, task.metadata["answer"], None)

    @staticmethod
    def _question(keys: list[str]) -> str:
        if len(keys) == 1:
            return f"\n\nQuestion: What is the secret code of {keys[0]}? Answer with the code only."
        listed = ", ".join(keys[:-1]) + f" and {keys[-1]}"
        return (f"\n\nQuestion: What are the secret codes of {listed}? Answer with the codes in that order, "
                "separated by commas.")


def _prefix_sums(values: list[int]) -> list[int]:
    sums, total = [0], 0
    for value in values:
        total += value
        sums.append(total)
    return sums


def _position_at(offsets: list[int], fraction: float) -> int:
    """The piece boundary whose token offset is closest to `fraction` of the whole."""
    target = fraction * offsets[-1]
    return min(range(len(offsets)), key=lambda i: abs(offsets[i] - target))


def _depth_of(document: str, fact: str) -> float:
    """Where `fact` starts in the document's text (question excluded), as a fraction of its characters."""
    body = document.rsplit("\n\nQuestion:", 1)[0]
    return round(body.find(fact.strip()) / max(1, len(body) - len(fact.strip())), 4)
