"""Demo stage `dpo`: preference pairs from the SFT model's own verified samples, then DPO.

The SFT model samples several answers to fresh train-split tasks of the RL stage's domains; each is judged
by the task's verifier; a verified success and a model failure of the same task make a pair (the same
flywheel `posttrain data pairs` runs on an RL run's episodes). No human labels, no reward model.
"""

from __future__ import annotations

import time
from typing import Any

from posttrain.data import episodes_to_pairs, write_records
from posttrain.demo.pipeline import DemoRun, demo_stage, source
from posttrain.demo.sft import evaluate_stage
from posttrain.tasks import get_domain, sample_tasks
from posttrain.tracking import say
from posttrain.types import SamplingParams, Task

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


def _sample_episodes(run: DemoRun, policy):
    from posttrain.config import ModelConfig
    from posttrain.envs import run_episodes
    from posttrain.models import load_model, load_tokenizer
    from posttrain.rollout import HFEngine

    settings = run.recipe.dpo_pairs
    tasks: list[Task] = []
    domains = run.recipe.rl.domains
    for index, spec in enumerate(domains):
        count = settings.prompts // len(domains)
        tasks += sample_tasks(get_domain(spec.name, **spec.args), count, level=spec.levels, split="train",
                              seed=run.recipe.seed + 500 + index)
    config = ModelConfig(path=str(policy))
    tokenizer = load_tokenizer(config)
    engine = HFEngine(load_model(config, tokenizer), tokenizer, max_batch_size=256)
    sampling = SamplingParams(max_new_tokens=run.recipe.eval.max_new_tokens, temperature=settings.temperature,
                              seed=run.recipe.seed)
    return run_episodes(engine, tasks, tokenizer, sampling, n=settings.samples)
