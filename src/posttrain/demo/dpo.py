"""Demo stage `dpo`: preference pairs from the SFT model's own verified samples, then DPO.

The SFT model samples several answers to fresh train-split tasks of the RL stage's domains; each is judged
by the task's verifier; a verified success and a model failure of the same task make a pair (the same
flywheel `posttrain data pairs` runs on an RL run's episodes). No human labels, no reward model.
"""

from __future__ import annotations

import time
from typing import Any

from posttrain.data import episodes_to_pairs, write_records
from posttrain.demo.evaluation import TIMEOUT_SCALE, stage_runtime
from posttrain.demo.pipeline import DemoRun, demo_stage, source
from posttrain.demo.sft import evaluate_stage
from posttrain.tasks import get_domain, sample_tasks
from posttrain.tracking import say
from posttrain.types import Task, Trajectory

PAIRS_FILE = "dpo_pairs.jsonl"


@demo_stage("dpo")
def dpo(run: DemoRun) -> dict[str, Any]:
    from posttrain.rl import episode_record
    from posttrain.train import run_dpo

    started = time.perf_counter()
    policy = run.model_after("sft")
    episodes = _sample_episodes(run, policy)
    pairs = episodes_to_pairs([episode_record(t, 0) for t in episodes], per_task=run.recipe.dpo_pairs.per_task,
                              seed=run.recipe.seed, source="demo-sft-samples")
    if pairs:  # an empty file would be a data error for whoever reads it (the report's contamination check)
        write_records(run.data_dir / PAIRS_FILE, pairs)
    sampled_pass_rate = round(sum(t.reward.passed for t in episodes) / max(len(episodes), 1), 4)
    if not pairs:
        # A model that solves every sampled task, or none, has no success/failure pair to learn from; the next
        # stage then starts from the SFT checkpoint.
        say(f"[dpo] no pairs: no task had both a verified success and a failure among {len(episodes)} samples "
            f"(pass rate {sampled_pass_rate:.1%}); DPO skipped")
        return {"pairs": 0, "skipped": "no success/failure pairs", "sampled_pass_rate": sampled_pass_rate,
                "seconds": round(time.perf_counter() - started, 1)}

    recipe = run.recipe.dpo.model_copy(deep=True)
    recipe.output_dir = str(run.root / "dpo")
    recipe.model.path = str(policy)
    recipe.data.train = [source(run.data_dir / PAIRS_FILE)]
    recipe.runtime.seed = run.recipe.seed
    result = run_dpo(recipe, resume=run.resume)
    return evaluate_stage(
        run, result.final_dir, seconds=time.perf_counter() - started, steps=result.steps, pairs=len(pairs),
        train_seconds=round(result.seconds + result.reference_seconds, 1), sampled_pass_rate=sampled_pass_rate,
        preference_accuracy={"start": result.heldout_start.get("preference_accuracy"),
                             "end": result.heldout.get("preference_accuracy")},
    )


def _sample_episodes(run: DemoRun, policy_dir) -> list[Trajectory]:
    """The SFT model's samples of fresh train-split tasks, judged, through the evaluation runner the stages'
    evaluations use (batched engine calls; the DPO recipe's precision, so `precision: auto` samples in bf16 on a
    CPU with native bf16 as RL and the evaluations do; the same timeout scale for queueing on a busy CPU)."""
    from posttrain.config import EvalSampling
    from posttrain.evaluate import load_policy, run_items

    settings = run.recipe.dpo_pairs
    tasks: list[Task] = []
    domains = run.recipe.rl.domains
    for index, spec in enumerate(domains):
        count = settings.prompts // len(domains)
        tasks += sample_tasks(get_domain(spec.name, **spec.args), count, level=spec.levels, split="train",
                              seed=run.recipe.seed + 500 + index)
    runtime = stage_runtime(run.recipe.dpo.runtime, run.recipe.eval.batch_size, timeout_scale=TIMEOUT_SCALE)
    sampling = EvalSampling(max_new_tokens=run.recipe.eval.max_new_tokens, greedy=False, n=settings.samples,
                            k=[1], temperature=settings.temperature, seed=run.recipe.seed)
    items, _ = run_items(load_policy(policy_dir, runtime), tasks, sampling, runtime)
    return [episode for item in items for episode in item.samples]
