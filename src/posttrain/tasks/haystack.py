"""The parts long-context domains share: token budgets, filler text, and where in a document something sits.

Lengths are in tokens. With a tokenizer (a local directory, or any object a Hugging Face tokenizer call accepts)
they are the tokenizer's own counts: every filler sentence is counted once, when the domain is built, as it
appears inside a document (after one space), and a document is filled by adding those counts. Byte-level BPE
(the built-in tokenizer's, GPT-2's, Llama-3's) splits text into words before merging, so a sentence that starts
with a letter after a space is tokenized the same alone and in context, and the sum is exact; the finished
prompt is counted once more and trimmed if a boundary merged otherwise. Without a tokenizer a length is an
estimate, ``ceil(characters / chars_per_token)`` (4.0 by default, about right for English and a large vocabulary;
a 512-token vocabulary like the built-in one spends about one token per 2-3 characters), and the task says so
(``metadata["tokens_exact"]``).

So making a 32k-token task costs a few thousand list appends and one tokenizer call, not a tokenizer call per
sentence (tests/test_tasks_long_context.py times it).

Every long-context task carries the metadata the report's length x depth heat map reads:
``length`` (the level's target in tokens), ``context_tokens`` (the prompt's measured or estimated length) and
``depth`` (where the evidence starts, as a fraction of the document: 0 = the first token, 1 = the last).
"""

from __future__ import annotations

import math
import random
from typing import Any, Sequence

from posttrain.tasks.base import TaskError

# Filler: plain sentences without digits (the answers are numbers and names), built from a small vocabulary so a
# tokenizer trained on the run's text knows every word.
_SUBJECTS = ["The river", "An old bridge", "The market", "A quiet village", "The northern road", "The harbour",
             "A small orchard", "The library", "The mountain pass", "An empty field", "The museum", "A narrow lane",
             "The garden", "The railway station", "A wooden boat", "The lighthouse", "The forest", "A stone wall"]
_VERBS = ["stood beside", "looked out over", "ran along", "faced", "was built near", "sheltered", "led toward",
          "overlooked", "was hidden behind", "curved around", "was painted like", "slowly changed"]
_OBJECTS = ["the valley", "the eastern hills", "a field of barley", "the town square", "the grey sea",
            "an abandoned mill", "the winter camp", "a row of chestnut trees", "the city gate", "the frozen lake",
            "a busy workshop", "the old chapel", "the salt marsh", "a ring of standing stones"]
_TAILS = ["for many years", "in the early morning", "after the long rain", "during the summer fair",
          "as the travellers remembered it", "long before the war", "under a pale sky", "at the end of the season",
          "without anyone noticing", "while the bells rang", "in every old story", "when the snow came"]


def filler_sentences(seed: int = 0, size: int = 600) -> list[str]:
    """`size` distinct filler sentences (there are 36,288 to choose from), deterministic in `seed`."""
    rng = random.Random(f"filler:{seed}")
    seen: set[str] = set()
    while len(seen) < size:
        seen.add(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}.")
    return sorted(seen)


def filler_vocabulary() -> list[str]:
    """Every filler word, for a corpus that trains a tokenizer (so no stage meets an unseen word)."""
    return [" ".join(_SUBJECTS + _VERBS + _OBJECTS + _TAILS)]


class TokenCounter:
    """Token counts of text: exact with a tokenizer, ``ceil(len / chars_per_token)`` without."""

    def __init__(self, tokenizer: Any = None, chars_per_token: float = 4.0):
        if chars_per_token <= 0:
            raise TaskError(f"chars_per_token must be > 0, got {chars_per_token}")
        if isinstance(tokenizer, str):
            tokenizer = _load_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.chars_per_token = chars_per_token
        # Whether a text's count is the sum of its pieces' (each piece counted as it appears, e.g. " The ...").
        # True for byte-level BPE, which splits words before merging; checked on a probe, else every
        # finished prompt is counted whole (and trimmed).
        self.additive = True
        if tokenizer is not None:
            probe = [*(" " + s for s in filler_sentences(0, 40)), " The secret code of Varholt is 482913.",
                     "\n\nDocument 12:\n", "Mara Quill works at Apex Systems.", "\n\n--- Page 3 ---\n",
                     "| Cloud | 120 | 3400 |", "\n\nQuestion: What is the secret code of Varholt?"]
            self.additive = self.count("".join(probe)) == sum(self.counts(probe))

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def counts(self, texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        if self.tokenizer is None:
            return [math.ceil(len(text) / self.chars_per_token) for text in texts]
        encoded = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return [len(ids) for ids in encoded]

    def count(self, text: str) -> int:
        return self.counts([text])[0]


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise TaskError(f"tokenizer '{path}': could not load it ({str(error).splitlines()[0]})") from None


class Filler:
    """A pool of filler sentences with their token counts (as they appear after a space in a document)."""

    def __init__(self, counter: TokenCounter, seed: int = 0, size: int = 600):
        self.counter = counter
        self.sentences = filler_sentences(seed, size)
        self.tokens = counter.counts([" " + s for s in self.sentences])

    def draw(self, rng: random.Random, budget_tokens: int) -> list[int]:
        """Indices of filler sentences whose tokens add up to at most `budget_tokens` (and close to it)."""
        picks: list[int] = []
        used = 0
        smallest = min(self.tokens)
        while used + smallest <= budget_tokens:
            index = rng.randrange(len(self.sentences))
            if used + self.tokens[index] > budget_tokens:
                index = self.tokens.index(smallest)
            picks.append(index)
            used += self.tokens[index]
        return picks


def check_lengths(lengths: Sequence[int], name: str, minimum: int = 64) -> list[int]:
    """`lengths` as a list, strictly increasing and at least `minimum`: level L is `lengths[L - 1]` tokens."""
    values = list(lengths)
    if not values or any(not isinstance(v, int) or v < minimum for v in values):
        raise TaskError(f"{name}: lengths must be integers >= {minimum} (tokens), got {values}")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise TaskError(f"{name}: lengths must increase with the level (the curriculum climbs them), got {values}")
    return values


def check_depths(depths: Sequence[float], name: str) -> list[float]:
    values = [float(d) for d in depths]
    if not values or any(not 0.0 <= d <= 1.0 for d in values):
        raise TaskError(f"{name}: depths must be fractions in [0, 1], got {list(depths)}")
    return values


def level_length(lengths: Sequence[int], level: int, name: str) -> int:
    if not 1 <= level <= len(lengths):
        raise TaskError(f"{name}: level {level} outside 1..{len(lengths)}")
    return lengths[level - 1]


def fit_to_budget(render, pieces: list[str], protected: set[int], counter: TokenCounter, budget: int,
                  summed: int) -> tuple[str, int]:
    """`render(pieces)` and its tokens: `summed` (the pieces' counts added up) when the counter is additive, else
    counted whole, dropping filler pieces (never a `protected` one) while it is over `budget`."""
    text = render(pieces)
    if counter.additive:
        return text, summed
    tokens = counter.count(text)
    while tokens > budget:
        droppable = [i for i in range(len(pieces)) if i not in protected and pieces[i]]
        if not droppable:
            raise TaskError(f"the task's fixed text alone is {tokens} tokens, over its budget of {budget}")
        pieces[droppable[-1]] = ""
        text = render(pieces)
        tokens = counter.count(text)
    return text, tokens
