"""Decode tokens/s of speculative decoding in the built-in engine against plain decoding, at temperature 0.

    .venv/bin/python bench/speculative.py [--repeats 3] [--num-tokens 3 4] [--train-steps 30] [--draft-steps 120]

Target tiny-30m, draft tiny-3m (and prompt lookup), greedy, one sequence at a time (the latency-bound case
speculation is for): 8 arithmetic chat prompts, up to 64 new tokens each, run as 8 ``generate`` calls of one
request. Untrained random models agree on almost nothing, so both are trained first, briefly, on CPU:

* the target: ``--train-steps`` SFT steps (batch 16) on arithmetic chats ("What is a + b?" -> "a + b = c. The
  answer is c.");
* the draft: sequence-level distillation -- ``--draft-steps`` steps on the target's own greedy answers to 256 other
  arithmetic prompts (what a distilled student is), so it agrees with the target where a student would.

Plain, draft-model and prompt-lookup decoding are timed side by side, alternating their order every repeat;
figures are medians. All three must give the same tokens (checked). Besides tokens/s the JSON line has the
acceptance rate, the tokens per target pass, and the costs behind the ratio: the draft's forward over the
target's (one token, batch 1) and a k+1-token verify pass over a one-token pass of the target.

Takes ~10 minutes on a loaded 2-core machine, 4-7 of them training the two models.

Ends with one JSON line; ``"ratio"`` is the best draft-model speculative over plain tokens/s (over the
``--num-tokens`` values; prompt lookup runs with the largest).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from posttrain.models import build_tiny_model, train_tokenizer
from posttrain.rollout import HFEngine, Speculation
from posttrain.rollout.speculative import BlockRunner
from posttrain.types import GenerationRequest, SamplingParams

PROMPTS, NEW_TOKENS = 8, 64


def make_tokenizer():
    rng = random.Random(0)
    corpus = [f"What is {rng.randint(0, 999)} + {rng.randint(0, 999)}? Think step by step." for _ in range(500)]
    corpus += [f"{a} + {b} = {a + b}. The answer is {a + b}." for a, b in ((rng.randint(0, 99), 7) for _ in range(500))]
    return train_tokenizer(corpus, vocab_size=512)


def chat(tokenizer, question: str, answer: str | None = None) -> list[int] | str:
    messages = [{"role": "user", "content": question}]
    if answer is None:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    messages.append({"role": "assistant", "content": answer})
    return tokenizer.apply_chat_template(messages, tokenize=False)


def sft(model, tokenizer, texts: list[str], steps: int, batch: int = 16, lr: float = 3e-3) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        chunk = [texts[(step * batch + i) % len(texts)] for i in range(batch)]
        encoded = tokenizer(chunk, return_tensors="pt", padding=True)
        labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
        model(**encoded, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def make_models(tokenizer, steps: int, draft_steps: int):
    rng = random.Random(1)
    pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(16 * steps)]
    target = build_tiny_model("tiny-30m", tokenizer, seed=0)
    sft(target, tokenizer, [chat(tokenizer, f"What is {a} + {b}?", f"{a} + {b} = {a + b}. The answer is {a + b}.")
                            for a, b in pairs], steps)
    # Sequence-level distillation: the draft learns the target's own greedy answers.
    questions = [f"What is {rng.randint(0, 99)} + {rng.randint(0, 99)}?" for _ in range(256)]
    teacher = HFEngine(target, tokenizer, max_batch_size=128)
    answers = teacher.generate([GenerationRequest(chat(tokenizer, q)) for q in questions],
                               SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0))
    draft = build_tiny_model("tiny-3m", tokenizer, seed=0)
    sft(draft, tokenizer, [chat(tokenizer, q, a[0].text) for q, a in zip(questions, answers)], draft_steps)
    return target, draft


def run(engine: HFEngine, prompts: list[list[int]]) -> tuple[list[list[int]], int, float]:
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    outputs, started = [], time.perf_counter()
    for prompt in prompts:
        outputs.append(engine.generate([GenerationRequest(prompt)], sampling)[0][0].token_ids)
    return outputs, sum(len(o) for o in outputs), time.perf_counter() - started


def pass_costs(target, draft, prompt: list[int], k: int, repeats: int = 30) -> dict:
    """Seconds of one forward of the draft vs the target (1 token), and of a (k+1)-token target verify pass."""

    def timed(runner: BlockRunner, width: int) -> float:
        runner.start([prompt], 1, len(prompt) + 2 * k + 8)
        feed = [prompt[-1:] * width]
        times = []
        with torch.inference_mode():
            for _ in range(repeats):
                started = time.perf_counter()
                runner.forward(feed)
                times.append(time.perf_counter() - started)
        return statistics.median(times)

    target_runner, draft_runner = BlockRunner(target, None, "target"), BlockRunner(draft, None, "draft")
    one, block, small = timed(target_runner, 1), timed(target_runner, k + 1), timed(draft_runner, 1)
    return {"target_1_token_ms": round(one * 1e3, 2), f"target_{k + 1}_tokens_ms": round(block * 1e3, 2),
            "draft_1_token_ms": round(small * 1e3, 2), "draft_over_target": round(small / one, 3),
            "verify_over_one_token": round(block / one, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[3, 4], help="draft tokens per round (k)")
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--draft-steps", type=int, default=120)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = make_tokenizer()
    started = time.perf_counter()
    target, draft = make_models(tokenizer, args.train_steps, args.draft_steps)
    train_s = time.perf_counter() - started
    prompts = [chat(tokenizer, f"What is {17 * i + 3} + {29 * i + 11}?") for i in range(PROMPTS)]
    engines = {"plain": HFEngine(target, tokenizer)}
    for k in args.num_tokens:
        engines[f"draft-k{k}"] = HFEngine(target, tokenizer, speculative=Speculation(draft, k, name="tiny-3m"))
    k = max(args.num_tokens)
    engines[f"ngram-k{k}"] = HFEngine(target, tokenizer, speculative=Speculation(None, k, args.ngram, "ngram"))
    speculative = [name for name in engines if name != "plain"]
    reference = run(engines["plain"], prompts)[0]  # warm-up, and the tokens every variant must give
    for name in speculative:
        if run(engines[name], prompts)[0] != reference:
            raise SystemExit(f"{name}: greedy output differs from plain decoding")
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for repeat in range(args.repeats):
        order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
        for name in order:
            _, tokens, seconds = run(engines[name], prompts)
            rates[name].append(tokens / seconds)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    figures = {}
    for name in speculative:
        stats = engines[name].stats
        figures[name] = {"tokens_per_s": round(medians[name], 1), "ratio": round(medians[name] / medians["plain"], 2),
                         "acceptance_rate": round(stats.acceptance_rate or 0.0, 3),
                         "tokens_per_target_pass": round(stats.completion_tokens / stats.speculative_rounds, 2)}
        print(f"{name:6s} {medians[name]:8.1f} tok/s  x{figures[name]['ratio']:.2f}  "
              f"acceptance {figures[name]['acceptance_rate']:.3f}  tokens/pass {figures[name]['tokens_per_target_pass']}")
    print(f"plain  {medians['plain']:8.1f} tok/s")
    summary = {
        "bench": "speculative",
        "target": "tiny-30m", "draft": "tiny-3m (sequence-distilled from the target)",
        "train_steps": args.train_steps, "draft_steps": args.draft_steps, "train_s": round(train_s, 1),
        "temperature": 0.0, "ngram": args.ngram,
        "prompts": PROMPTS, "max_new_tokens": NEW_TOKENS, "threads": torch.get_num_threads(),
        "repeats": args.repeats, "tokens": sum(len(o) for o in reference),
        "plain_tokens_per_s": round(medians["plain"], 1),
        "results": figures,
        "costs": {f"k{k}": pass_costs(target, draft, prompts[0], k) for k in args.num_tokens},
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "ratio": max(figures[name]["ratio"] for name in speculative if name.startswith("draft")),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
