"""Demo stage `distill`: the high-speed tier. The newest trained policy (after RL, else DPO or SFT; tiny-3m) is
distilled into a fresh tiny-1m built on its tokenizer. The packaged recipe distils logits on the SFT
demonstrations (`mode: logit` with no task domains: the student learns the teacher's whole next-token
distribution at every position of the demonstrations, which no sampling has to produce first, so a student that
starts from nothing gets off the ground within the demo's budget). With `mode: on_policy` (GKD) the student answers
fresh prompts of the RL stage's domains and the teacher scores each of its tokens; `distill.data_fraction` of each
batch then comes from the SFT demonstrations.

The summary entry holds the student's held-out accuracy (like every stage) and both tiers side by side: each
one's held-out accuracy, parameters and greedy decode tokens/s on the same held-out prompts.
"""

from __future__ import annotations

import time
from typing import Any

from posttrain.demo.base import SFT_FILE, load_heldout
from posttrain.demo.evaluation import stage_runtime
from posttrain.demo.pipeline import DemoRun, demo_stage, source
from posttrain.demo.sft import evaluate_stage

SPEED_PROMPTS = 64  # held-out prompts each tier decodes for its tokens/s


@demo_stage("distill")
def distill(run: DemoRun) -> dict[str, Any]:
    from posttrain.config import DomainConfig
    from posttrain.rl import EngineAnswerSampler
    from posttrain.train import run_distill

    started = time.perf_counter()
    teacher_stage, teacher = run.latest_policy(("rl", "dpo", "sft"))
    recipe = run.recipe.distill.model_copy(deep=True)
    recipe.output_dir = str(run.root / "distill")
    recipe.teacher.path = str(teacher)
    recipe.runtime.seed = run.recipe.seed
    on_demonstrations = recipe.mode == "logit" and not recipe.tasks.domains
    if on_demonstrations or (recipe.distill.data_fraction > 0 and not recipe.data.train):
        recipe.data.train = [source(run.data_dir / SFT_FILE)]
    if not on_demonstrations and not recipe.tasks.domains:
        recipe.tasks.domains = [DomainConfig(name=d.name, args=d.args, levels=d.levels, weight=d.weight)
                                for d in run.recipe.rl.domains]
    sampler = EngineAnswerSampler(recipe.tasks, seed=recipe.runtime.seed)
    result = run_distill(recipe, resume=run.resume, sampler=sampler)
    figures = evaluate_stage(run, result.final_dir, seconds=time.perf_counter() - started, steps=result.steps,
                             teacher=teacher_stage, train_seconds=round(result.seconds, 1),
                             kl_to_teacher={"start": result.heldout_start.get("eval/kl"),
                                            "end": result.heldout.get("eval/kl")},
                             agreement={"start": result.heldout_start.get("eval/agreement"),
                                        "end": result.heldout.get("eval/agreement")})
    teacher_heldout = run.summary["stages"].get(teacher_stage, {}).get("heldout", {})
    figures["tiers"] = {
        "standard": {"stage": teacher_stage, "heldout": teacher_heldout, **decode_speed(run, teacher)},
        "fast": {"stage": "distill", "heldout": figures["heldout"], **decode_speed(run, result.final_dir)},
    }
    return figures


def decode_speed(run: DemoRun, model_dir) -> dict[str, Any]:
    """Parameters and greedy decode tokens/s of the model at `model_dir` on the first held-out prompts (the
    demo's eval batch size and token budget, the distill recipe's precision as the evaluations run it; the
    messages only, without tool schemas: a speed probe)."""
    from posttrain.data import prompt_ids
    from posttrain.evaluate import load_policy
    from posttrain.models import count_parameters
    from posttrain.types import GenerationRequest, SamplingParams

    policy = load_policy(model_dir, stage_runtime(run.recipe.distill.runtime, run.recipe.eval.batch_size))
    engine, tokenizer = policy.engine, policy.tokenizer
    tasks = load_heldout(run)[:SPEED_PROMPTS]
    requests = [GenerationRequest(ids) for ids in prompt_ids(tokenizer, [task.messages for task in tasks])]
    sampling = SamplingParams(max_new_tokens=run.recipe.eval.max_new_tokens, temperature=0.0)
    engine.generate(requests[:4], sampling)  # warm-up: first-call allocations are not decoding
    started = time.perf_counter()
    completions = engine.generate(requests, sampling)
    seconds = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for group in completions for c in group)
    return {"parameters": count_parameters(engine.model), "decode_tokens_per_s": round(tokens / max(seconds, 1e-9))}
