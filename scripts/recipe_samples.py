"""Writes the small data samples the packaged `sft-chat` and `dpo-pairs` recipes ship with.

    python scripts/recipe_samples.py      # rewrites src/posttrain/recipes/data/{sft-chat,dpo-pairs}/

The samples are deterministic (seeded) and deliberately in several formats, so the recipes show each reader:
OpenAI messages (some with content as a list of parts), ShareGPT, an Alpaca CSV with its own column names;
explicit prompt/chosen/rejected pairs and implicit (UltraFeedback-binarized) pairs with scores.
Tasks a tiny model learns in minutes: sums, reversing a word, sorting a few numbers.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src" / "posttrain" / "recipes" / "data"
WORDS = ("table", "river", "stone", "cloud", "apple", "green", "light", "music", "plant", "sugar", "tiger",
         "water", "bread", "chair", "dream", "flame", "glass", "heart", "lemon", "night", "ocean", "pearl")


def sums(rng: random.Random, count: int) -> list[tuple[str, str, int]]:
    items = []
    for _ in range(count):
        digits = rng.choice((1, 2, 2, 3))
        a, b = rng.randrange(10 ** digits), rng.randrange(10 ** digits)
        items.append((f"What is {a}+{b}?", str(a + b), digits))
    return items


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def sft_chat(rng: random.Random) -> None:
    out = ROOT / "sft-chat"
    messages = []
    for i, (question, answer, digits) in enumerate(sums(rng, 160)):
        content = [{"type": "text", "text": question}] if i % 3 == 0 else question  # list of parts, or a string
        turns = [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
        if i % 4 == 0:
            turns.insert(0, {"role": "system", "content": "Answer with the number only."})
        messages.append({"messages": turns, "metadata": {"domain": "arithmetic", "difficulty": digits}})
    write_jsonl(out / "messages.jsonl", messages)
    sharegpt = []
    for _ in range(120):
        word = rng.choice(WORDS)
        sharegpt.append({"conversations": [{"from": "human", "value": f"Reverse the word {word}."},
                                           {"from": "gpt", "value": word[::-1]}],
                         "category": "strings"})
    write_jsonl(out / "sharegpt.jsonl", sharegpt)
    with open(out / "alpaca.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["task", "numbers", "answer", "level", "kind"])
        for _ in range(120):
            size = rng.randint(3, 5)
            numbers = [rng.randrange(10) for _ in range(size)]
            writer.writerow(["Sort these numbers from smallest to largest.", " ".join(map(str, numbers)),
                             " ".join(map(str, sorted(numbers))), size - 2, "sorting"])


def dpo_pairs(rng: random.Random) -> None:
    out = ROOT / "dpo-pairs"
    explicit = []
    for question, answer, digits in sums(rng, 200):
        wrong = str(int(answer) + rng.choice((-10, -1, 1, 10)) if int(answer) >= 10 else int(answer) + 1)
        explicit.append({"prompt": [{"role": "user", "content": question}], "chosen": answer, "rejected": wrong,
                         "metadata": {"domain": "arithmetic", "difficulty": digits}})
    write_jsonl(out / "explicit.jsonl", explicit)
    implicit = []
    for _ in range(150):
        word = rng.choice(WORDS)
        user = {"role": "user", "content": f"Reverse the word {word}."}
        implicit.append({"chosen": [user, {"role": "assistant", "content": word[::-1]}],
                         "rejected": [user, {"role": "assistant", "content": word}],
                         "score_chosen": 9.0, "score_rejected": rng.choice((1.0, 2.0, 3.0)), "topic": "strings"})
    write_jsonl(out / "implicit.jsonl", implicit)


if __name__ == "__main__":
    generator = random.Random(16)
    sft_chat(generator)
    dpo_pairs(generator)
