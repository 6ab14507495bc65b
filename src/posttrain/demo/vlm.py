"""The `vlm-demo`: SFT then GRPO on generated image tasks with the built-in tiny VLM, on a CPU, with the held-out
pass@1 before, after SFT and after RL.

    posttrain demo --recipe vlm-demo [--quick] [--output DIR] [a.b=c ...]
    python -m posttrain.demo.vlm src/posttrain/recipes/vlm-demo.yaml [a.b=c ...]     # the same, without the CLI

Reads top to bottom: a tokenizer trained on the tasks' text -> `build_tiny_vlm` -> demonstrations (the answer alone)
and held-out tasks (split by hash) -> held-out pass@1 (greedy) -> SFT (`train.run_vision_sft`) -> pass@1 ->
GRPO (`rl.run_vision_grpo`, fresh training tasks every step) -> pass@1 -> `results.json`, `report.html` (the
image section with thumbnails of the bad cases) and the model with its processor in `output_dir/model`.
Budgets are steps, so a seed gives the same figures on any machine (the wall time is load-dependent).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from posttrain.config import VLMDemoRecipe, load_recipe
from posttrain.data import validate_vision_record
from posttrain.evaluate import (ImageSuiteScore, image_suite_json, paired_difference, render_report,
                                score_image_suite)
from posttrain.models import build_tiny_vlm, train_tokenizer
from posttrain.rl import image_engine, run_vision_grpo
from posttrain.tasks import get_domain, sample_tasks
from posttrain.train import run_vision_sft


def run_vlm_demo(recipe: VLMDemoRecipe) -> dict:
    torch.manual_seed(recipe.seed)
    out = Path(recipe.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    domains = [get_domain(name, canvas=recipe.canvas) for name in recipe.domains]
    demos = [t for d in domains for t in sample_tasks(d, recipe.demos, level=recipe.levels, split="train",
                                                        seed=recipe.seed)]
    heldout = [t for d in domains for t in sample_tasks(d, recipe.heldout, level=recipe.levels, split="heldout",
                                                          seed=recipe.seed)]
    texts = [part["text"] for t in demos for m in t.messages if isinstance(m["content"], list)
             for part in m["content"] if part.get("type") == "text"] + [t.metadata["answer"] for t in demos]
    tokenizer = train_tokenizer(texts, vocab_size=recipe.vocab_size)
    model, processor = build_tiny_vlm(tokenizer, seed=recipe.seed)
    scores, figures = {}, {"seed": recipe.seed}

    def score(label: str) -> None:
        started = time.perf_counter()
        scores[label] = score_image_suite(image_engine(model, processor), processor, heldout, name="held-out")
        print(f"[vlm-demo] {label}: held-out pass@1 {scores[label].pass_at_1:.1%} {scores[label].per_domain} "
              f"({time.perf_counter() - started:.0f}s)", flush=True)

    score("base")
    samples = [validate_vision_record({"messages": t.messages + [{"role": "assistant", "content": t.metadata["answer"]}]})
               for t in demos]
    started = time.perf_counter()
    sft = run_vision_sft(model, processor, samples, steps=recipe.sft.steps, lr=recipe.sft.lr,
                         batch_size=recipe.sft.batch_size, seed=recipe.seed, warmup_steps=recipe.sft.warmup_steps)
    figures["sft"] = {"steps": recipe.sft.steps, "loss_first": sft.losses[0], "loss_last": sft.losses[-1],
                      "seconds": time.perf_counter() - started}
    print(f"[vlm-demo] sft: {recipe.sft.steps} steps, loss {sft.losses[0]:.3f} -> {sft.losses[-1]:.3f}", flush=True)
    score("sft")
    rl = recipe.rl
    started = time.perf_counter()

    trained = [d for d in domains if not rl.domains or d.name in rl.domains]

    def fresh(step: int, count: int) -> list:  # new training tasks every step (seeded by the step)
        return [t for i, d in enumerate(trained) for t in sample_tasks(
            d, max(1, count // len(trained)), level=recipe.levels, split="train",
            seed=recipe.seed * 7919 + (step + 2) * 101 + i)]

    grpo = run_vision_grpo(model, processor, fresh, steps=rl.steps, tasks_per_step=rl.tasks_per_step,
                           group_size=rl.group_size, lr=rl.lr, temperature=rl.temperature,
                           max_new_tokens=rl.max_new_tokens, seed=recipe.seed,
                           log=lambda f: print(f"[vlm-demo] rl step {f['step']}: reward {f['reward_mean']:.3f}, "
                                               f"{f['trained_sequences']} sequences trained", flush=True))
    figures["rl"] = {"steps": rl.steps, "self_test_gap_max": grpo.self_test["gap_abs_max"],
                     "reward_first": grpo.steps[0]["reward_mean"] if grpo.steps else None,
                     "reward_last": grpo.steps[-1]["reward_mean"] if grpo.steps else None,
                     "seconds": time.perf_counter() - started}
    score("rl")
    figures["heldout"] = {label: {"pass@1": s.pass_at_1, **s.per_domain} for label, s in scores.items()}
    figures["rl_gain_over_sft"] = scores["rl"].pass_at_1 - scores["sft"].pass_at_1
    figures["rl_gain_by_domain"] = paired_gain(scores["sft"], scores["rl"])
    results = {"title": "vlm-demo", "figures": figures,
               "images": {label: {"held-out": image_suite_json(s)} for label, s in scores.items()}}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.html").write_text(render_report(results))
    model.save_pretrained(out / "model")
    processor.save_pretrained(out / "model")
    for name, gain in figures["rl_gain_by_domain"].items():
        print(f"[vlm-demo] {name}: rl - sft {gain['gain']:+.1%} (standard error {gain['standard_error']:.1%}, "
              f"{gain['items']} items: {gain['better']} better, {gain['worse']} worse)", flush=True)
    print(f"[vlm-demo] held-out pass@1: base {scores['base'].pass_at_1:.1%}, sft {scores['sft'].pass_at_1:.1%}, "
          f"rl {scores['rl'].pass_at_1:.1%} (rl - sft {figures['rl_gain_over_sft']:+.1%}); {out / 'report.html'}")
    return figures


def paired_gain(before: ImageSuiteScore, after: ImageSuiteScore) -> dict[str, dict]:
    """Per domain, the change in pass@1 from `before` to `after` on the same held-out items, with its paired
    standard error (`posttrain.evaluate.paired_difference`)."""
    def outcomes(score: ImageSuiteScore, name: str) -> dict[str, float]:
        return {case.task_id: float(case.passed) for case in score.cases if case.domain == name}

    return {name: paired_difference(outcomes(before, name), outcomes(after, name)) for name in after.per_domain}


def main(argv: list[str]) -> int:
    recipe = load_recipe(argv[0], argv[1:], schema=VLMDemoRecipe)
    run_vlm_demo(recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
