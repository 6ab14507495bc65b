"""Demo stages `rl` and `sft_control`: RL on fresh verifiable tasks, and the honest control for it.

`rl` starts from the newest trained model (after DPO when that stage ran, else after SFT) and trains on
tasks generated fresh every step and scored by the domains' verifiers — no demonstrations. Domains that measure
lengths in tokens get the policy's tokenizer. `sft_control`
continues SFT from the SFT checkpoint on the *same* demonstrations for the same wall time the RL stage took,
at the learning rate SFT ended with: if RL's gain were only "more training", the control would match it.
"""

from __future__ import annotations

from typing import Any

from posttrain.demo.base import SFT_FILE, counts_tokens
from posttrain.demo.pipeline import DemoRun, demo_stage, source
from posttrain.demo.sft import evaluate_stage


@demo_stage("rl")
def rl(run: DemoRun) -> dict[str, Any]:
    from posttrain.rl import run_rl

    started_from, policy = run.latest_policy(("dpo", "sft"))
    recipe = run.recipe.rl.model_copy(deep=True)
    recipe.output_dir = str(run.root / "rl")
    recipe.model.path = str(policy)
    recipe.runtime.seed = run.recipe.seed
    for spec in recipe.domains:  # long-context domains measure their lengths in the policy's own tokens
        if counts_tokens(spec):
            spec.args = {**spec.args, "tokenizer": str(policy)}
    result = run_rl(recipe, resume=run.resume)
    last = result.history[-1] if result.history else {}
    return evaluate_stage(run, result.final_dir, seconds=result.seconds, steps=result.steps, started_from=started_from,
                          final_train_reward=round(last.get("reward/mean", 0.0), 4),
                          curriculum=result.curriculum, mix_trained=result.mix_trained)


@demo_stage("sft_control")
def sft_control(run: DemoRun) -> dict[str, Any]:
    from posttrain.train import run_sft

    rl_seconds = run.summary["stages"].get("rl", {}).get("seconds")
    if rl_seconds is None:
        from posttrain.types import PosttrainError

        raise PosttrainError("demo: sft_control matches the RL stage's wall time; put it after 'rl' in stages")
    recipe = run.recipe.sft.model_copy(deep=True)
    recipe.output_dir = str(run.root / "sft_control")
    recipe.model.path = str(run.model_after("sft"))
    recipe.data.train = [source(run.data_dir / SFT_FILE)]
    recipe.runtime.seed = run.recipe.seed + 1  # a new epoch order, not a replay of SFT's
    recipe.optim.lr = recipe.optim.lr * recipe.optim.min_lr_ratio  # where SFT's schedule ended
    recipe.optim.schedule, recipe.optim.warmup_steps = "constant", 0
    recipe.train.max_steps, recipe.train.epochs = None, 1000.0
    recipe.train.max_minutes = rl_seconds / 60
    result = run_sft(recipe, resume=run.resume)
    return evaluate_stage(run, result.final_dir, seconds=result.seconds, steps=result.steps)
