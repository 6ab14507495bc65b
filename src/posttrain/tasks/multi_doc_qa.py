"""Multi-document QA: a question whose answer chains facts from two or three of many short documents.

A task is a small world of people, companies and cities (made-up names). Each person's document says where they
work, each company's where its headquarters are, each city's which province it lies in, every document padded
with filler sentences. The question asks about one person:

    hops 2: "In which city is the headquarters of the company where Mara Quill works?"  (person -> company -> city)
    hops 3: "In which province ..."                                     (person -> company -> city -> province)

so the answer is in neither the person's document nor any single one: the model has to read the company name in
one document and find that company's own document. Distractor chains (other people, companies, cities and
provinces, all consistent) fill the prompt to the level's length; the documents are shuffled. Judged by
``exact`` against the name.

Difficulty = length (as `needle`: level L is ``lengths[L - 1]`` tokens, in `tokenizer`'s tokens when given).
``metadata["depth"]`` is where the document holding the answer starts, ``evidence_depths`` where each hop's does.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Sequence

from posttrain.data import SFTSample
from posttrain.tasks.base import TaskError, demo_sample, domain, task_id
from posttrain.tasks.haystack import Filler, TokenCounter, check_lengths, level_length
from posttrain.tasks.needle import place_names
from posttrain.types import Task

DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
_FIRST = ["Mara", "Tobin", "Ilse", "Quentin", "Odile", "Ravi", "Selma", "Jonas", "Priya", "Anders", "Lucia", "Emeka",
          "Hana", "Viktor", "Nadia", "Felix", "Greta", "Omar", "Talia", "Bruno", "Ingrid", "Kenji", "Leona", "Mateo"]
_LAST = ["Quill", "Harrow", "Vance", "Okafor", "Lindqvist", "Moreau", "Castell", "Brandt", "Ashby", "Novak",
         "Ferreira", "Holm", "Takeda", "Renner", "Duval", "Sorensen", "Marsh", "Kowal", "Adair", "Pike"]
_FIRMS = ["Apex", "Borealis", "Cobalt", "Delta", "Ember", "Fathom", "Granite", "Helix", "Indigo", "Juniper",
          "Keystone", "Lattice", "Meridian", "Nimbus", "Orbit", "Pinnacle", "Quasar", "Radiant", "Summit", "Tundra"]
_FIRM_KINDS = ["Systems", "Foods", "Logistics", "Textiles", "Robotics", "Pharma", "Media", "Energy"]
_PROVINCES = ["Alderia", "Brevonne", "Calmaris", "Dunmore", "Estravel", "Ferrowen", "Galtier", "Hollin",
              "Ivarra", "Jestova", "Korrin", "Lusardi"]


@domain("multi_doc_qa")
class MultiDocQA:
    name = "multi_doc_qa"

    def __init__(self, lengths: Sequence[int] = DEFAULT_LENGTHS, hops: int = 2, filler_sentences: int = 3,
                 tokenizer: Any = None, chars_per_token: float = 4.0, reserve_tokens: int = 24,
                 system_prompt: str | None = None):
        self.lengths = check_lengths(lengths, self.name, minimum=128)
        if hops not in (2, 3):
            raise TaskError(f"multi_doc_qa: hops must be 2 or 3, got {hops}")
        self.max_level = len(self.lengths)
        self.hops, self.filler_sentences = hops, filler_sentences
        self.counter = TokenCounter(tokenizer, chars_per_token)
        self.filler = Filler(self.counter)
        self.reserve_tokens = reserve_tokens
        self.system_prompt = system_prompt
        self._headers: list[int] = []
        self._separator_tokens = self.counter.count("\n\n")

    def make_task(self, rng: random.Random, level: int) -> Task:
        length = level_length(self.lengths, level, self.name)
        budget = length - self.reserve_tokens
        people = rng.sample([f"{a} {b}" for a in _FIRST for b in _LAST], len(_FIRST) * len(_LAST))
        firms = rng.sample([f"{a} {b}" for a in _FIRMS for b in _FIRM_KINDS], len(_FIRMS) * len(_FIRM_KINDS))
        cities = place_names(rng, 240)
        # The target chain first; each distractor chain adds one person, and a new company and city while they last.
        person, firm, city, province = people[0], firms[0], cities[0], rng.choice(_PROVINCES)
        evidence = [self._person_doc(person, firm), self._firm_doc(firm, city)]
        if self.hops == 3:
            evidence.append(self._city_doc(city, province))
        answer = city if self.hops == 2 else province
        question = self._question(person)
        # Every distractor chain's documents, counted in one call; chains are added while the budget holds them.
        chains = []
        for chain in range(1, len(people)):
            new = [self._person_doc(people[chain], firms[chain % len(firms)])]
            if chain < len(firms):
                new.append(self._firm_doc(firms[chain], cities[chain % len(cities)]))
            if self.hops == 3 and chain < len(cities):
                new.append(self._city_doc(cities[chain], rng.choice(_PROVINCES)))
            chains.append(new)
        flat = evidence + [doc for new in chains for doc in new]
        fact_tokens = dict(zip(flat, self.counter.counts(flat)))
        header_tokens = self._header_tokens(len(flat))
        filler_mean = sum(self.filler.tokens) / len(self.filler.tokens)
        overhead = max(header_tokens) + self._separator_tokens + self.filler_sentences * filler_mean
        documents = list(evidence)
        used = sum(fact_tokens[d] + overhead for d in documents) + self.counter.count(question)
        for new in chains:
            cost = sum(fact_tokens[d] + overhead for d in new)
            if used + cost > budget:
                break
            documents += new
            used += cost
        if used > budget:
            raise TaskError(f"multi_doc_qa: level {level} ({length} tokens) cannot hold the evidence documents; "
                            "raise its length or lower filler_sentences")
        order = list(range(len(documents)))
        rng.shuffle(order)
        # Filler inside the documents: each its share of the budget left after the facts and the markup.
        share = int(self.filler_sentences * filler_mean + (budget - used) / len(documents))
        pads = [self.filler.draw(rng, share) for _ in documents]
        summed = (sum(header_tokens[:len(documents)]) + sum(fact_tokens[d] for d in documents)
                  + sum(self.filler.tokens[i] for pad in pads for i in pad)
                  + self._separator_tokens * (len(documents) - 1) + self.counter.count(question))
        prompt, tokens = self._fit(documents, pads, order, question, budget, summed)
        evidence_depths = [round(prompt.find(f"Document {order.index(i) + 1}:\n") / len(prompt), 4)
                           for i in range(len(evidence))]
        messages = [{"role": "user", "content": prompt}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        key = hashlib.sha1(prompt.encode()).hexdigest()
        return Task(
            id=task_id(self.name, key), domain=self.name, difficulty=level, messages=messages,
            verifier="exact", verifier_args={"answer": answer}, max_steps=1, timeout_s=60.0,
            metadata={"problem_key": key, "answer": answer, "length": length, "context_tokens": tokens,
                      "tokens_exact": self.counter.exact, "depth": evidence_depths[-1],
                      "evidence_depths": evidence_depths, "hops": self.hops, "documents": len(documents),
                      "chain": [person, firm, city] + ([province] if self.hops == 3 else [])},
        )

    def demonstration(self, task: Task) -> SFTSample:
        return demo_sample(task, task.metadata["answer"], None)

    def _header_tokens(self, count: int) -> list[int]:
        """Tokens of "Document N:\n" for N = 1..count (cached: the same for every task)."""
        while len(self._headers) < count:
            start = len(self._headers) + 1
            self._headers += self.counter.counts([f"Document {n}:\n" for n in range(start, start + 256)])
        return self._headers

    def _fit(self, documents, pads, order, question, budget, summed) -> tuple[str, int]:
        """The prompt and its tokens: `summed` (its pieces' counts) where the counter is additive; else counted
        whole, dropping filler sentences from the documents in turn while it is over budget."""

        def render() -> str:
            texts = [f"Document {number}:\n{documents[index]}" + "".join(" " + self.filler.sentences[i]
                                                                         for i in pads[index]) + "\n\n"
                     for number, index in enumerate(order, start=1)]
            return "".join(texts).rstrip() + question

        prompt = render()
        if self.counter.additive:
            return prompt, summed
        tokens = self.counter.count(prompt)
        turn = 0
        while tokens > budget:
            candidates = [i for i in range(len(pads)) if pads[i]]
            if not candidates:
                raise TaskError(f"multi_doc_qa: the documents alone are {tokens} tokens, over the budget {budget}")
            for _ in range(max(1, (tokens - budget) // 8)):
                index = candidates[turn % len(candidates)]
                if pads[index]:
                    pads[index].pop()
                turn += 1
            prompt = render()
            tokens = self.counter.count(prompt)
        return prompt, tokens

    @staticmethod
    def _person_doc(person: str, firm: str) -> str:
        return f"{person} works as an analyst at {firm}."

    @staticmethod
    def _firm_doc(firm: str, city: str) -> str:
        return f"{firm} has its headquarters in {city}."

    @staticmethod
    def _city_doc(city: str, province: str) -> str:
        return f"The city of {city} lies in the province of {province}."

    def _question(self, person: str) -> str:
        what = "city" if self.hops == 2 else "province"
        return (f"\n\nQuestion: In which {what} is the headquarters of the company where {person} works? "
                f"Answer with the name only.")
